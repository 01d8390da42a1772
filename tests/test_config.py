"""PTDConfig / PCTreeConfig / parse_speculative_config / the method registry: defaults and
refusals."""
import logging

import pytest

from vllm_ptd import LOGGER_NAME
from vllm_ptd.budget import REALIZED_MARGIN
from vllm_ptd.config import MethodConfig, parse_speculative_config
from vllm_ptd.methods import find_method, method_names
from vllm_ptd.pctree.config import PCTreeConfig, tree_node_bound
from vllm_ptd.ptd.config import DEVICE_BUDGETS, PTDConfig


def test_ptd_defaults_follow_the_paper_and_resolve_per_device():
    c = PTDConfig()
    assert (c.width, c.depth) == (4, 6)
    with pytest.raises(ValueError, match="resolve"):
        c.max_tree_nodes
    cpu, gpu = c.resolved("cpu"), c.resolved("cuda:0")
    assert cpu.max_verify_nodes == DEVICE_BUDGETS["cpu"]["max_verify_nodes"]
    assert cpu.max_draft_nodes == DEVICE_BUDGETS["cpu"]["max_draft_nodes"]
    assert gpu.max_tree_nodes == sum(DEVICE_BUDGETS["cuda"].values())
    assert cpu.draft_attention == "causal" and gpu.draft_attention == "tree"
    explicit = PTDConfig(max_draft_nodes=5, draft_attention="tree").resolved("cpu")
    assert explicit.max_draft_nodes == 5 and explicit.draft_attention == "tree"
    assert c.max_draft_nodes is None  # resolved() returns a copy


@pytest.mark.parametrize("key,value,pattern", [
    ("width", 0, r"'width'.*\[1, 16\]"),
    ("width", 17, r"'width'.*\[1, 16\]"),
    ("width", 2.0, r"'width'.*integer"),
    ("width", True, r"'width'.*integer"),
    ("depth", 33, r"'depth'.*\[1, 32\]"),
    ("max_draft_nodes", -1, r"'max_draft_nodes'.*\[0, 512\]"),
    ("max_verify_nodes", 0, r"'max_verify_nodes'.*\[1, 512\]"),
    ("pool_key_nodes", 0, r"'pool_key_nodes'"),
    ("pool_max_nodes", "big", r"'pool_max_nodes'.*integer"),
    ("seeding", "ner", r"'seeding'.*\['random', 'entity'\]"),
    ("num_seeds", 65, r"'num_seeds'.*\[0, 64\]"),
    ("pool_from_prompt", 1, r"'pool_from_prompt'.*true or false"),
    ("pool_from_output", "yes", r"'pool_from_output'"),
    ("draft_attention", "full", r"'draft_attention'.*\['tree', 'causal'\]"),
    ("seed", -1, r"'seed'"),
])
def test_ptd_bad_values_name_key_and_range(key, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        PTDConfig(**{key: value})
    with pytest.raises(ValueError, match=pattern):
        parse_speculative_config({"method": "ptd", key: value})


@pytest.mark.parametrize("key,value,pattern", [
    ("branching", 0, r"'branching'.*\[1, 64\]"),
    ("max_nodes", 1, r"'max_nodes'.*\[2, 512\]"),
    ("depth", 0, r"'depth'.*\[1, 64\]"),
    ("mode", "marginal", r"'mode'.*\['pctree', 'shared', 'chain'\]"),
    ("model", 3, r"'model'"),
    ("drafter_dtype", "int8", r"'drafter_dtype'.*\['auto', 'float32', 'bfloat16', 'float16'\]"),
    ("drafter_gemm", "fp8", r"'drafter_gemm'.*\['auto', 'float', 'int8'\]"),
])
def test_pctree_bad_values_name_key_and_range(key, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        PCTreeConfig(**{key: value})
    with pytest.raises(ValueError, match=pattern):
        parse_speculative_config({"method": "pctree", key: value})


def test_pctree_defaults_and_chain_mode():
    c = PCTreeConfig()
    with pytest.raises(ValueError, match="resolve"):
        c.max_tree_nodes
    tree = c.for_block_size(7)
    assert (tree.branching, tree.depth) == (4, 7) and tree.max_tree_nodes == c.max_nodes - 1
    chain = PCTreeConfig(mode="chain").for_block_size(7)
    # a chain of a block-7 drafter has at most 7 nodes: the reservation is 7, not N - 1 = 15
    assert (chain.branching, chain.depth) == (1, 7) and chain.max_tree_nodes == 7
    assert PCTreeConfig(mode="chain", branching=1).for_block_size(7) == chain
    with pytest.raises(ValueError, match=r"'chain'.*'branching'\] = 8"):
        PCTreeConfig(mode="chain", branching=8)
    with pytest.raises(ValueError, match=r"'depth'\] = 9 exceeds the drafter's block size 7"):
        PCTreeConfig(depth=9).for_block_size(7)
    assert tree_node_bound(2, 3, 100) == 2 + 2 * 4  # k + (depth - 1) k^2


def test_pctree_model_names_a_folder_or_a_packaged_drafter(tmp_path):
    from vllm_ptd.pctree.method import packaged_drafters, resolve_drafter_path

    packaged = packaged_drafters()
    assert packaged, "the package ships its drafters"
    for folder in packaged:
        assert resolve_drafter_path(folder.name, None) == folder
    assert resolve_drafter_path(str(tmp_path), None) == tmp_path
    with pytest.raises(ValueError, match=r"'no-such-drafter' is neither a folder nor a packaged "
                                         rf"drafter \({packaged[0].name}"):
        resolve_drafter_path("no-such-drafter", None)


def test_pctree_drafter_dtype(monkeypatch):
    import torch
    from vllm_ptd.pctree import config as pctree_config

    c = PCTreeConfig()
    assert PCTreeConfig(drafter_dtype="float32").drafter_torch_dtype(torch.bfloat16, "cpu") == torch.float32
    monkeypatch.setattr(pctree_config, "cpu_has_fast_bf16", lambda: True)
    assert c.drafter_torch_dtype(torch.float32, "cpu") == torch.bfloat16
    assert c.drafter_torch_dtype(torch.float32, "cuda") == torch.float32  # the engine's elsewhere
    monkeypatch.setattr(pctree_config, "cpu_has_fast_bf16", lambda: False)
    assert c.drafter_torch_dtype(torch.float32, "cpu") == torch.float32
    assert c.drafter_torch_dtype(torch.bfloat16, "cpu") == torch.float32  # AVX2 only
    assert c.drafter_torch_dtype(torch.bfloat16, "cuda") == torch.bfloat16


def test_pctree_drafter_gemm(monkeypatch):
    """"auto" takes the engine's int8 GEMM where it has one and the CPU has int8 dot-product
    units, "float" never does, "int8" always, and "int8" where the engine has none is
    refused naming the key."""
    from vllm_ptd.pctree import config as pctree_config

    def float_gemm(w, b):
        return None

    def int8_gemm(w, b):
        return None

    monkeypatch.setattr(pctree_config, "cpu_has_fast_int8", lambda: True)
    assert PCTreeConfig().drafter_linear_kernel(float_gemm, int8_gemm) is int8_gemm
    assert PCTreeConfig().drafter_linear_kernel(float_gemm, None) is float_gemm
    monkeypatch.setattr(pctree_config, "cpu_has_fast_int8", lambda: False)  # AVX2 only
    assert PCTreeConfig().drafter_linear_kernel(float_gemm, int8_gemm) is float_gemm
    said: list[logging.LogRecord] = []  # on the plugin's logger itself: vLLM's "vllm"
    handler = logging.Handler()           # logger may not pass records up to the root
    handler.emit = said.append
    logging.getLogger(LOGGER_NAME).addHandler(handler)
    try:  # asked for: kept, and said
        assert PCTreeConfig(drafter_gemm="int8").drafter_linear_kernel(
            float_gemm, int8_gemm) is int8_gemm
    finally:
        logging.getLogger(LOGGER_NAME).removeHandler(handler)
    assert any("'drafter_gemm'] = 'int8' on a CPU without int8 dot-product units"
               in r.getMessage() and r.levelno == logging.WARNING for r in said)
    monkeypatch.setattr(pctree_config, "cpu_has_fast_int8", lambda: True)
    assert PCTreeConfig(drafter_gemm="float").drafter_linear_kernel(float_gemm, int8_gemm) is float_gemm
    assert PCTreeConfig(drafter_gemm="int8").drafter_linear_kernel(float_gemm, int8_gemm) is int8_gemm
    with pytest.raises(ValueError, match=r"'drafter_gemm'\] = 'int8' needs"):
        PCTreeConfig(drafter_gemm="int8").drafter_linear_kernel(float_gemm, None)
    # refused before any engine starts where no engine has it
    with pytest.raises(ValueError, match=r"'drafter_gemm'\] = 'int8' runs on .* cuda"):
        PCTreeConfig(drafter_gemm="int8").resolved("cuda", None)


def test_methods_are_found_by_name():
    assert set(method_names()) == {"ptd", "pctree"}
    assert find_method("ptd").config_cls is PTDConfig and not find_method("ptd").needs_hidden
    assert find_method("pctree").config_cls is PCTreeConfig and find_method("pctree").needs_hidden
    with pytest.raises(ValueError, match="'method'.*'eagle'"):
        find_method("eagle")


def test_parse_splits_ours_from_vllms():
    mc = parse_speculative_config({"method": "ptd", "width": 3, "num_speculative_tokens": 40,
                                   "disable_by_batch_size": 8})
    assert isinstance(mc, MethodConfig) and mc.method == "ptd"
    assert isinstance(mc.options, PTDConfig) and mc.options.width == 3
    assert mc.num_speculative_tokens == 40 and mc.disable_by_batch_size == 8
    assert mc.request_calibration is True
    mc = parse_speculative_config({"method": "pctree", "branching": 2,
                                   "request_calibration": False})
    assert isinstance(mc.options, PCTreeConfig) and mc.num_speculative_tokens is None
    assert mc.request_calibration is False
    assert mc.realized_margin == REALIZED_MARGIN
    assert parse_speculative_config({"method": "ptd", "realized_margin": None}).realized_margin is None
    assert parse_speculative_config({"method": "ptd", "realized_margin": 0}).realized_margin == 0.0
    assert mc.miss_backoff == "trees"
    assert parse_speculative_config({"method": "pctree", "miss_backoff": "all"}).miss_backoff == "all"


@pytest.mark.parametrize("cfg,pattern", [
    ({"method": "ptd", "widht": 4}, r"unknown key 'widht'.*allowed keys"),
    ({"method": "ptd", "branching": 4}, r"unknown key 'branching'"),  # a PCTree key
    ({"method": "pctree", "width": 4}, r"unknown key 'width'"),       # a PTD key
    ({"method": "eagle"}, r"'method'.*\['pctree', 'ptd'\]"),
    ({"method": "ptd", "disable_by_batch_size": 0}, r"'disable_by_batch_size'.*\[1, "),
    ({"method": "pctree", "request_calibration": 1}, r"'request_calibration'.*true or false"),
    ({"method": "ptd", "realized_margin": -0.1}, r"'realized_margin'.*number in \[0.0, 10.0\]"),
    ({"method": "ptd", "realized_margin": "high"}, r"'realized_margin'.*number"),
    ({"method": "ptd", "miss_backoff": "none"}, r"'miss_backoff'\] = 'none'.*\['trees', 'all'\]"),
    ({"width": 4}, r"'method'"),
    ({"method": "ptd", "num_speculative_tokens": 0}, r"'num_speculative_tokens'.*\[1, 4096\]"),
])
def test_parse_refuses_unknown_keys_and_methods(cfg, pattern):
    with pytest.raises(ValueError, match=pattern):
        parse_speculative_config(cfg)


def test_parse_refuses_non_dict():
    with pytest.raises(ValueError, match="dict"):
        parse_speculative_config([("method", "ptd")])
