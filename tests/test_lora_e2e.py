"""Multi-LoRA end to end: three PEFT adapters of one tiny Llama, registered in a real broker,
served in ONE mixed batch by the wrapped base model out of the broker's pages, and checked
sequence by sequence against PEFT running each adapter alone.

Everything is fp32 (the broker stores adapters as float32), so the only differences from
PEFT are summation order: the kernels accumulate x·Aᵀ and y·Bᵀ in their own order. Without a
CUDA device the broker keeps a host arena and the kernels run in Triton's interpreter; with
one, the broker serves a CUDA arena (``--arena cuda``) and everything runs on the device.
"""

from __future__ import annotations

import os
import sys

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    # Must precede the first import of triton (see tests/test_kernels.py).
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set; run with TRITON_INTERPRET=1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from memory_broker.broker.arena.cuda import cuda_available  # noqa: E402
from memory_broker.clients import BrokerClient, wrap_model  # noqa: E402
from adapter_fixtures import ADAPTERS, LLAMA  # noqa: E402
from conftest import start_broker  # noqa: E402

if CUDA:
    # Compiled kernels need the weights on the device: the host arena cannot serve them.
    _vmm, _why = cuda_available("0")
    pytestmark = pytest.mark.skipif(not _vmm, reason=f"a CUDA device without a usable CUDA arena ({_why})")
    ARENA = ["--arena", "cuda", "--page-size", "2MiB", "--slab-size", "8MiB", "--pool-size", "64MiB"]
else:
    ARENA = ["--pool-size", "64MiB", "--slab-size", "4MiB", "--page-size", "512KiB"]
DEVICE = torch.device("cuda" if CUDA else "cpu")

NAMES = ("r4", "r8", "r16")  # ranks 4, 8, 16; different target modules; r16 uses rsLoRA
SEQ_ADAPTERS = ["r4", "r8", None, "r16", "r8"]
SEQ_LEN = 12
# fp32 on both sides; observed differences are below 4e-7 (summation order through two layers).
# 1e-4 leaves two orders of magnitude of headroom and stays far below the LoRA effect
# asserted below (which must exceed 100x the tolerance).
ATOL = RTOL = 1e-4


def fresh_base(path: str):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path).to(DEVICE).eval()


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory):
    """The saved base model's directory, and name -> directory of a PEFT adapter on that base."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("lora-e2e")
    torch.manual_seed(0)
    base_dir = str(root / "base")
    LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(base_dir)
    dirs = {}
    for seed, name in enumerate(NAMES, start=1):
        torch.manual_seed(seed)
        peft_model = get_peft_model(fresh_base(base_dir), LoraConfig(init_lora_weights=False, **ADAPTERS[name]))
        dirs[name] = str(root / name)
        peft_model.save_pretrained(dirs[name])
    return base_dir, dirs


@pytest.fixture(scope="module")
def expected(base_and_adapters):
    """For the batch: the base model's logits, and each adapter's logits under PEFT."""
    from peft import PeftModel

    base_dir, dirs = base_and_adapters
    ids = input_ids()
    with torch.no_grad():
        out = {None: fresh_base(base_dir)(ids).logits}
        for name in NAMES:
            out[name] = PeftModel.from_pretrained(fresh_base(base_dir), dirs[name]).eval()(ids).logits
    return out


def input_ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, LLAMA["vocab_size"], (len(SEQ_ADAPTERS), SEQ_LEN), generator=g).to(DEVICE)


@pytest.fixture(scope="module")
def broker_with_adapters(base_and_adapters):
    _, dirs = base_and_adapters
    b = start_broker(*ARENA, "--adapter-dtype", "float32")
    try:
        with BrokerClient.connect(b.socket) as c:
            for name in NAMES:
                c.register_adapter(name, dirs[name])
        yield b
    finally:
        b.stop()


@pytest.mark.parametrize("path", ["auto", "token"])
def test_one_mixed_batch_matches_peft_sequence_by_sequence(base_and_adapters, expected, broker_with_adapters, path):
    base_dir, _ = base_and_adapters
    model = fresh_base(base_dir)
    lora = wrap_model(model)
    ids = input_ids()
    with BrokerClient.connect(broker_with_adapters.socket) as client:
        with client.acquire_adapters(list(NAMES)) as lease:
            batch = lora.batch(client, SEQ_ADAPTERS, [SEQ_LEN] * len(SEQ_ADAPTERS), lease, path=path)
            with torch.no_grad(), lora.step(batch):
                got = model(ids).logits
            del batch  # holds a view of this client's mapping, which close() unmaps
    assert [a.adapter_id for a in lease.adapters] == list(NAMES)

    base = expected[None]
    for i, name in enumerate(SEQ_ADAPTERS):
        want = expected[name][i]
        if name is None:
            # Base-only tokens are never touched: the same numbers as the plain model's batch.
            assert torch.equal(got[i], want), f"sequence {i} (base only) differs from the base model"
            continue
        torch.testing.assert_close(got[i], want, atol=ATOL, rtol=RTOL, msg=lambda m: f"sequence {i} ({name}): {m}")
        # The adapter really acted: far outside the tolerance from the base model's logits.
        effect = (want - base[i]).abs().max().item()
        assert effect > 100 * ATOL, f"{name} changes logits by only {effect:.2e}; the comparison proves nothing"
        assert (got[i] - base[i]).abs().max().item() > 100 * ATOL, f"sequence {i} ({name}) got no LoRA delta"


def test_the_auto_path_serves_this_prefill_by_segments(base_and_adapters, broker_with_adapters):
    # 60 tokens over 3 adapters: 20 per adapter, past the segment path's threshold of 16.
    base_dir, _ = base_and_adapters
    lora = wrap_model(fresh_base(base_dir))
    with BrokerClient.connect(broker_with_adapters.socket) as client:
        with client.acquire_adapters(list(NAMES)) as lease:
            batch = lora.batch(client, SEQ_ADAPTERS, [SEQ_LEN] * len(SEQ_ADAPTERS), lease)
            assert batch.plan.path == "segment" and batch.num_slots == 3
            del batch
