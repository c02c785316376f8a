"""Old module paths of linattn 0.1 still import for a release, each read warning where the name lives now."""
import importlib
import warnings

import pytest

import linattn

# every name of linattn 0.1's linattn.__all__
PUBLIC_0_1 = [
    "softmax_attention", "linear_attention", "linear_attention_step", "retention", "gated_linear_attention",
    "delta_rule", "gated_delta_rule", "sequence_parallel_linear_attention", "ring_softmax_attention",
    "LinearAttentionState", "elu_plus_one", "relu", "get_feature_map", "squared_relu", "DPFPFeatures",
    "PerformerFeatures", "TaylorFeatures", "HedgehogFeatures", "CosFormerFeatures", "distill_feature_map", "set_seed",
    "default_device", "use_book_style", "book_figure", "finish_figure", "LinearAttention", "LinearMultiheadAttention",
    "LinearMixer", "MixerState", "ShortConvolution", "apply_rope", "SoftmaxAttention", "TransformerBlock",
    "TransformerConfig", "TransformerLM", "KVCache", "DecodingState",
]

# (old module, name, new module): a sample of every moved module, and every name the chapters imported
MOVED = [
    ("linattn.recurrent", "LinearAttentionState", "linattn.state"),
    ("linattn.recurrent", "linear_attention_step", "linattn.attention"),
    ("linattn.mixers", "LinearMixer", "linattn.layers.mixer"),
    ("linattn.mixers", "MixerState", "linattn.state"),
    ("linattn.mixers", "RULES", "linattn.layers.mixer"),
    ("linattn.positions", "apply_rope", "linattn.layers.positions"),
    ("linattn.positions", "DEFAULT_POSITIONS", "linattn.layers.positions"),
    ("linattn.tasks", "multi_query_associative_recall", "linattn.data.recall"),
    ("linattn.tasks", "needle_in_a_haystack", "linattn.data.recall"),
    ("linattn.tasks", "recall_accuracy", "linattn.data.recall"),
    ("linattn.tasks", "recall_vocab", "linattn.data.recall"),
    ("linattn.tasks", "tiny_shakespeare", "linattn.data.text"),
    ("linattn.tasks", "CharCorpus", "linattn.data.text"),
    ("linattn.utils", "book_figure", "linattn.book"),
    ("linattn.utils", "finish_figure", "linattn.book"),
    ("linattn.utils", "set_seed", "linattn.book"),
    ("linattn.utils", "COLUMN_WIDTH_IN", "linattn.book"),
    ("linattn.layers", "TransformerLM", "linattn.models"),
    ("linattn.layers", "KVCache", "linattn.state"),
    ("linattn.layers", "DecodingState", "linattn.state"),
    ("linattn.layers", "ATTENTIONS", "linattn.models"),
    ("linattn.ops._decay", "MILD_DECAY", "linattn.ops.decay"),
    ("linattn.ops._decay", "MILD_GATE", "linattn.ops.decay"),
    ("linattn.ops._decay", "gla_chunk", "linattn.ops.gla.chunk"),
    ("linattn.ops._wy", "wy_chunk", "linattn.ops.wy"),
    ("linattn.ops._wy", "scalar_decay", "linattn.ops.decay"),
    ("linattn.kernels.triton_chunk", "chunk_linear_attention_triton", "linattn.kernels.triton.chunk"),
    ("linattn.attention", "METHODS", "linattn.attention"),
]


@pytest.mark.parametrize("name", PUBLIC_0_1)
def test_every_name_of_the_old_public_api_imports_from_linattn_without_a_warning(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert getattr(linattn, name) is not None
    assert name in linattn.__all__


@pytest.mark.parametrize("old, name, new", MOVED, ids=[f"{o}.{n}" for o, n, _ in MOVED])
def test_an_old_path_warns_and_gives_the_object_of_the_new_one(old, name, new):
    if new.startswith("linattn.kernels.triton"):
        pytest.importorskip("triton", reason="Triton is not installed (pip install 'linattn[triton]')")
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} is deprecated .*; use {new}\."):
        got = getattr(module, name)
    expected = getattr(importlib.import_module(new), "LINEAR_ATTENTION_METHODS" if name == "METHODS" else name)
    assert got is expected


def test_from_import_of_an_old_path_warns_at_the_importing_line():
    with pytest.warns(DeprecationWarning) as record:
        from linattn.tasks import tiny_shakespeare  # noqa: F401
    assert record[0].filename == __file__


def test_the_readable_chunk_loop_kept_its_old_name_only_as_a_deprecated_alias():
    import linattn.ops.linear as linear

    with pytest.warns(DeprecationWarning, match="use linattn.ops.linear.naive.naive_chunk_linear_attention"):
        assert linear.chunk_linear_attention is linear.naive_chunk_linear_attention


def test_an_unknown_name_of_an_old_path_is_an_attribute_error():
    import linattn.tasks

    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        linattn.tasks.nope


def test_importing_linattn_imports_no_deprecated_module():
    import subprocess
    import sys

    code = ("import sys, warnings; warnings.simplefilter('error'); import linattn; "
            "old = {'linattn.recurrent', 'linattn.mixers', 'linattn.positions', 'linattn.tasks', 'linattn.utils', "
            "'linattn.ops._decay', 'linattn.ops._wy', 'linattn.kernels.triton_chunk'}; "
            "print(sorted(old & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
