"""The KV block mover (clients/vllm/block_mover.py): vLLM's KV cache layouts built with torch
alone, a step's blocks copied to scattered arena pages and back, byte for byte, in a fixed
number of launches per layer whatever the number of blocks. On a GPU (ops/gpu/run_gpu_checks.sh)
the same tests run on CUDA tensors and the Triton kernel; here on the CPU, with Triton
interpreted."""

from __future__ import annotations

import os
import sys

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    # Must precede the first import of triton (as tests/test_kernels.py).
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set; run with TRITON_INTERPRET=1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from memory_broker.clients.vllm.block_mover import BlockMover  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
NUM_BLOCKS, BLOCK, HEADS, HEAD = 12, 16, 2, 32
PAGE = 4096


def layout(name: str, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """One layer's KV cache in a vLLM layout, filled at random, and its block dimension."""

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype).to(DEVICE)

    if name == "flash_attn":  # FlashAttentionBackend: (2, num_blocks, block_size, num_kv_heads, head_size)
        return rand(2, NUM_BLOCKS, BLOCK, HEADS, HEAD), 1
    if name == "flashinfer_nhd":  # FlashInferBackend: (num_blocks, 2, block_size, num_kv_heads, head_size)
        return rand(NUM_BLOCKS, 2, BLOCK, HEADS, HEAD), 0
    if name == "flashinfer_hnd":  # the same shape with HND strides (stride order 0, 1, 3, 2, 4)
        return rand(NUM_BLOCKS, 2, HEADS, BLOCK, HEAD).permute(0, 1, 3, 2, 4), 0
    if name == "v032_lbnhc":  # vLLM 0.32's per-layer view (blocks, heads, tokens, 2 x head) in B,N,H,C order
        return rand(NUM_BLOCKS, BLOCK, HEADS, 2 * HEAD).permute(0, 2, 1, 3), 0
    raise AssertionError(name)


LAYOUTS = ("flash_attn", "flashinfer_nhd", "flashinfer_hnd", "v032_lbnhc")


def memory_order_bytes(t: torch.Tensor, dim: int, b: int) -> torch.Tensor:
    """Block ``b``'s elements in the tensor's memory order, as bytes (the object's format)."""
    bv = t.select(dim, b)
    perm = sorted(range(bv.dim()), key=lambda i: -bv.stride(i))
    return bv.permute(perm).contiguous().view(-1).view(torch.uint8).cpu()


def make(name: str, dtype: torch.dtype, layers: int = 3, backend: str = "torch"):
    gen = torch.Generator().manual_seed(hash((name, str(dtype))) % 2**31)
    kv = [layout(name, dtype, gen) for _ in range(layers)]
    mover = BlockMover([t for t, _ in kv], kv[0][1], PAGE, backend=backend)
    return kv, mover


def scattered_pages(mover: BlockMover, n: int, gen: torch.Generator) -> tuple[int, list[list[int]]]:
    """``n`` objects' pages, shuffled over an arena twice as big as they need."""
    k = mover.pages_per_block
    total = 2 * n * k
    order = torch.randperm(total, generator=gen).tolist()
    return total, [order[i * k : (i + 1) * k] for i in range(n)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", LAYOUTS)
def test_blocks_go_to_scattered_pages_and_back_byte_for_byte(name: str, dtype: torch.dtype, backend: str) -> None:
    kv, mover = make(name, dtype, backend=backend)
    dim = kv[0][1]
    gen = torch.Generator().manual_seed(7)
    block_ids = [9, 2, 5, 11]
    total, pages = scattered_pages(mover, len(block_ids), gen)
    phys = torch.zeros(total * PAGE, dtype=torch.uint8, device=DEVICE)
    originals = [t.clone() for t, _ in kv]

    mover.save(phys, block_ids, pages)
    host = phys.cpu()
    for b, obj_pages in zip(block_ids, pages):
        obj = torch.cat([host[p * PAGE : (p + 1) * PAGE] for p in obj_pages])
        want = torch.cat([memory_order_bytes(t, dim, b) for t, _ in kv])
        assert torch.equal(obj[: mover.block_nbytes], want)
    if name in ("flash_attn", "flashinfer_nhd"):
        # Block-contiguous layouts store what the CPU connector always stored: the block as it lies.
        assert torch.equal(
            memory_order_bytes(kv[0][0], dim, 9), kv[0][0].select(dim, 9).contiguous().view(-1).view(torch.uint8).cpu()
        )

    for t, _ in kv:
        t.zero_()
    mover.load(phys, block_ids, pages)
    for (t, _), orig in zip(kv, originals):
        for b in range(NUM_BLOCKS):
            got, want = t.select(dim, b), orig.select(dim, b)
            assert torch.equal(got, want if b in block_ids else torch.zeros_like(want)), (name, b)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_launches_per_layer_do_not_grow_with_the_blocks(backend: str) -> None:
    per_layer = 1 if backend == "triton" else 2
    counts = []
    for n in (1, 8):
        kv, mover = make("flash_attn", torch.float16, layers=4, backend=backend)
        total, pages = scattered_pages(mover, n, torch.Generator().manual_seed(n))
        phys = torch.zeros(total * PAGE, dtype=torch.uint8, device=DEVICE)
        mover.save(phys, list(range(n)), pages)
        mover.save(phys, list(range(n)), pages, layer=2)
        mover.load(phys, list(range(n)), pages)
        counts.append(mover.launches)
    assert counts == [per_layer * (4 + 1 + 4)] * 2


def test_a_host_arena_feeds_a_cache_on_another_device_or_the_same() -> None:
    kv, mover = make("flashinfer_hnd", torch.float16, backend="auto")
    total, pages = scattered_pages(mover, 3, torch.Generator().manual_seed(3))
    phys = torch.zeros(total * PAGE, dtype=torch.uint8)  # host pages
    before = [t.clone() for t, _ in kv]
    mover.save(phys, [0, 4, 7], pages)
    for t, _ in kv:
        t.zero_()
    mover.load(phys, [0, 4, 7], pages)
    for (t, _), orig in zip(kv, before):
        assert torch.equal(t[[0, 4, 7]], orig[[0, 4, 7]])


def test_refusals_name_what_is_wrong() -> None:
    kv, mover = make("flash_attn", torch.float16, layers=2)
    phys = torch.zeros(64 * PAGE, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="smaller than a block's"):
        mover.load(phys, [1], [[0]])
    with pytest.raises(ValueError, match="layers differ in KV bytes per block"):
        BlockMover([kv[0][0], torch.zeros(2, NUM_BLOCKS, 4, device=DEVICE)], 1, PAGE)
    with pytest.raises(ValueError, match="MEMORY_BROKER_KV_MOVER"):
        BlockMover([kv[0][0]], 1, PAGE, backend="cuda")
