import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.memplan import PagePolicy, StatePlacement, plan_memory
from transfer.presets import PRESETS, get_preset
from transfer.sizing import size_model

GEOMETRIES = {name: get_preset(name) for name in PRESETS}


@st.composite
def plan_inputs(draw):
    name = draw(st.sampled_from(sorted(GEOMETRIES)))
    geometry = GEOMETRIES[name]
    tp = draw(st.sampled_from(geometry.valid_tps()))
    return dict(
        geometry=geometry,
        tp=tp,
        budget_bytes=draw(st.integers(1, 2**37)),
        max_num_seqs=draw(st.integers(1, 512)),
        block_size=draw(st.sampled_from([1, 8, 16, 32, 64, 100, 256])),
        spec_tokens=draw(st.integers(0, 4)),
        page_policy=draw(st.sampled_from(list(PagePolicy))),
        placement=draw(st.sampled_from(list(StatePlacement))),
    )


@settings(max_examples=300, deadline=None)
@given(plan_inputs())
def test_plan_invariants(inputs):
    try:
        plan = plan_memory(**inputs)
    except ValueError as exc:
        assert "missing" in str(exc)
        return
    # Never over budget, and the leftover cannot hold another block.
    assert plan.used_bytes <= plan.budget_bytes
    assert (
        plan.budget_bytes - plan.used_bytes < max(plan.kv_block_bytes, 1) or not plan.kv_block_bytes
    )
    # One page size: both kinds of page fit in it, and the smaller was padded up to it.
    assert plan.page_bytes == max(plan.kv_page_bytes, plan.state_page_bytes)
    assert plan.block_size >= inputs["block_size"]
    # Enough state slots for every live request and its speculative tokens.
    assert plan.num_state_slots >= inputs["max_num_seqs"] * (1 + inputs["spec_tokens"])
    expected_padding = plan.num_state_slots * plan.state_pages_per_slot * (
        plan.page_bytes - plan.state_page_bytes
    ) + plan.num_kv_blocks * plan.kv_pages_per_block * (plan.page_bytes - plan.kv_page_bytes)
    assert plan.padding_bytes == expected_padding
    if plan.page_policy is PagePolicy.VLLM and plan.kv_page_bytes:
        assert plan.kv_page_bytes >= plan.state_page_bytes


@settings(max_examples=100, deadline=None)
@given(plan_inputs())
def test_seed_policy_is_never_further_from_state_page_than_vllm(inputs):
    inputs = dict(inputs, budget_bytes=2**50)
    seed = plan_memory(**dict(inputs, page_policy=PagePolicy.SEED))
    vllm = plan_memory(**dict(inputs, page_policy=PagePolicy.VLLM))
    assert abs(seed.kv_page_bytes - seed.state_page_bytes) <= abs(
        vllm.kv_page_bytes - vllm.state_page_bytes
    )


def test_vllm_policy_on_qwen3_next_per_layer():
    # one GDN layer's state = 1,097,728 B; one GQA layer = 2,048 B/token;
    # the smallest multiple of 16 tokens covering it is 544 tokens = 1,114,112 B.
    plan = plan_memory(
        get_preset("qwen3-next-80b-a3b"), 1, 2**36, 64, page_policy="vllm", placement="per_layer"
    )
    assert plan.block_size == 544
    assert plan.page_bytes == 1_114_112
    assert plan.state_page_bytes == 1_097_728
    assert plan.num_state_slots == 64 and plan.state_pages_per_slot == 36


def test_mla_models_align_blocks_to_64():
    plan = plan_memory(get_preset("kimi-linear-48b-a3b"), 1, 2**36, 8, block_size=16)
    assert plan.block_size % 64 == 0


def test_state_reserved_before_kv():
    geometry = get_preset("tiny-qwen3-next")
    sizing = size_model(geometry, 1)
    plan = plan_memory(geometry, 1, 64 * 2**20, 16, spec_tokens=1)
    assert plan.num_state_slots == 32
    assert plan.state_page_bytes == sizing.state_bytes_per_slot


def test_budget_too_small_says_how_much_is_missing():
    with pytest.raises(ValueError) as info:
        plan_memory(get_preset("tiny-qwen3-next"), 1, 1_000_000, 16)
    message = str(info.value)
    assert "max_num_seqs=16" in message
    # 16 slots x 116,736 B + one 116,736 B block = 1,984,512 B; 984,512 B short.
    assert "missing 984512 B" in message


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("max_num_seqs", {"max_num_seqs": 0}),
        ("block_size", {"block_size": 0}),
        ("spec_tokens", {"spec_tokens": -1}),
    ],
)
def test_bad_numbers_name_the_field(field, kwargs):
    args = dict(geometry=get_preset("tiny-qwen3-next"), tp=1, budget_bytes=2**30, max_num_seqs=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        plan_memory(**args)
