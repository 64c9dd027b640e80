"""Tiny PEFT LoRA adapters for the adapter tests, and a harness around a real host arena.

The adapters are real: a random tiny Llama wrapped by PEFT and saved with
``save_pretrained``. Beside each one, ``reference.safetensors`` holds an input ``x`` and
what PEFT's own LoRA layers add to every adapted module's output for it (``delta.L.module``),
so tests can check scaling, layout and offsets end to end against PEFT.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time

import pytest

from memory_broker.broker.adapters import AdapterConfig, AdapterManager, AdapterRegistry
from memory_broker.broker.arena.base import ArenaGeometry
from memory_broker.broker.arena.host import HostArena, HostArenaView
from memory_broker.broker.store.objects import ObjectStore, StoreConfig
from memory_broker.broker.store.pool import PagePool, WindowSpace

LLAMA = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
# name -> LoraConfig arguments (ranks 4, 8, 16; several target modules; rsLoRA; patterns).
ADAPTERS = {
    "r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "r16": dict(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], use_rslora=True),
    "pattern": dict(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "up_proj"],
        rank_pattern={"layers.1.self_attn.q_proj": 4},
        alpha_pattern={"v_proj": 32},
    ),
}


def build_peft_adapter(path: str, seed: int, **lora) -> None:
    """Save a PEFT LoRA adapter of a random tiny Llama to ``path``, plus its reference outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))
    peft_model.save_pretrained(path)
    x = torch.randn(5, max(LLAMA["hidden_size"], LLAMA["intermediate_size"]))
    ref = {"x": x}
    scalings = {}
    with torch.no_grad():
        for name, module in peft_model.named_modules():
            if not hasattr(module, "lora_A") or "default" not in getattr(module, "lora_A", {}):
                continue
            parts = name.split(".")
            layer = int(parts[parts.index("layers") + 1])
            short = parts[-1]
            xin = x[:, : module.base_layer.in_features]
            ref[f"delta.{layer}.{short}"] = module(xin) - module.base_layer(xin)
            scalings[f"{layer}.{short}"] = module.scaling["default"]
    save_file(ref, os.path.join(path, "reference.safetensors"))
    with open(os.path.join(path, "scalings.json"), "w") as f:
        json.dump(scalings, f)


def build_adapters(root: str) -> dict[str, str]:
    out = {}
    for seed, (name, lora) in enumerate(ADAPTERS.items()):
        path = os.path.join(root, name)
        build_peft_adapter(path, seed, **lora)
        out[name] = path
    return out


@pytest.fixture(scope="session")
def peft_dirs(tmp_path_factory) -> dict[str, str]:
    """name -> directory of a saved PEFT adapter (read-only: copy before changing one)."""
    return build_adapters(str(tmp_path_factory.mktemp("peft")))


def copy_adapter(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: str, **changes) -> None:
    cfg_path = os.path.join(path, "adapter_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


def edit_tensors(path: str, fn) -> None:
    """Rewrite the adapter's safetensors: ``fn(dict of tensors)`` changes it in place."""
    from safetensors.torch import load_file, save_file

    wpath = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(wpath)
    fn(tensors)
    save_file(tensors, wpath)


class AdapterHarness:
    """A real host arena, page pool, window, object store, registry and adapter manager.

    Store events for the manager's system session go to the manager (the wiring the
    server will do); every event is also recorded in ``events``.
    """

    def __init__(
        self,
        state_dir: str,
        *,
        page_size: int = 8192,
        pages_per_slab: int = 8,
        max_slabs: int = 8,
        config: AdapterConfig | None = None,
        store_config: StoreConfig | None = None,
        clock=time.monotonic,
        executor=None,
        page_writer=None,
        **registry_kwargs,
    ):
        self.geometry = ArenaGeometry(page_size, pages_per_slab, max_slabs, pages_per_slab * max_slabs * 2)
        self.arena = HostArena(self.geometry, name="adapter-test")
        self.pool = PagePool(self.geometry.max_pages, pages_per_slab, 0, grow=self.arena.grow)
        self.events: list[tuple[int, object]] = []
        self.manager: AdapterManager | None = None
        self.store = ObjectStore(
            self.pool,
            WindowSpace(self.geometry.window_pages),
            config=store_config or StoreConfig(high_watermark=1.0, low_watermark=1.0),
            notify=self._notify,
            clock=clock,
        )
        self.registry = AdapterRegistry(state_dir, **registry_kwargs)
        self.manager = AdapterManager(
            self.store,
            self.arena,
            self.registry,
            config or AdapterConfig(dtype="float32"),
            executor=executor,
            page_writer=page_writer(self.arena.view) if page_writer else None,
        )

    def _notify(self, session: int, event: object) -> None:
        self.events.append((session, event))
        if self.manager is not None:
            self.manager.handle_store_event(session, event)

    def reader(self) -> HostArenaView:
        """An independent mapping of the same slab fds (what a client process would map)."""
        view = HostArenaView(self.geometry)
        for i in range(self.arena.num_slabs):
            view.attach_slab(i, self.arena.slab_fd(i), readonly=True)
        return view

    async def close(self) -> None:
        await self.manager.close()
        self.registry.close()
        self.arena.close()


def run(coro):
    return asyncio.run(coro)
