"""PTDConfig / PCTreeConfig / parse_speculative_config: defaults and refusals."""
import pytest

from vllm_ptd.config import (DEVICE_BUDGETS, MethodConfig, PCTreeConfig, PTDConfig,
                             parse_speculative_config)


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
])
def test_pctree_bad_values_name_key_and_range(key, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        PCTreeConfig(**{key: value})
    with pytest.raises(ValueError, match=pattern):
        parse_speculative_config({"method": "pctree", key: value})


def test_pctree_defaults_and_chain_mode():
    c = PCTreeConfig()
    assert c.max_tree_nodes == c.max_nodes - 1
    assert PCTreeConfig(mode="chain", branching=4).branching == 1


def test_parse_splits_ours_from_vllms():
    mc = parse_speculative_config({"method": "ptd", "width": 3, "num_speculative_tokens": 40,
                                   "disable_by_batch_size": 8})
    assert isinstance(mc, MethodConfig) and mc.method == "ptd"
    assert isinstance(mc.options, PTDConfig) and mc.options.width == 3
    assert mc.num_speculative_tokens == 40 and mc.extra_vllm == {"disable_by_batch_size": 8}
    mc = parse_speculative_config({"method": "pctree", "branching": 2})
    assert isinstance(mc.options, PCTreeConfig) and mc.num_speculative_tokens is None


@pytest.mark.parametrize("cfg,pattern", [
    ({"method": "ptd", "widht": 4}, r"unknown key 'widht'.*allowed keys"),
    ({"method": "ptd", "branching": 4}, r"unknown key 'branching'"),  # a PCTree key
    ({"method": "pctree", "width": 4}, r"unknown key 'width'"),       # a PTD key
    ({"method": "eagle"}, r"'method'.*\['ptd', 'pctree'\]"),
    ({"width": 4}, r"'method'"),
    ({"method": "ptd", "num_speculative_tokens": 0}, r"'num_speculative_tokens'.*\[1, 4096\]"),
])
def test_parse_refuses_unknown_keys_and_methods(cfg, pattern):
    with pytest.raises(ValueError, match=pattern):
        parse_speculative_config(cfg)


def test_parse_refuses_non_dict():
    with pytest.raises(ValueError, match="dict"):
        parse_speculative_config([("method", "ptd")])
