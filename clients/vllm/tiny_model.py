"""A tiny random Llama, its tokenizer and PEFT LoRA adapters, built offline in a folder, for
trying the connector, its tests and its benchmark without downloading a model.

The weights are drawn wide (N(0, 0.5)) so that greedy tokens depend on every position's KV
and react to an adapter: a wrong KV block shows up as different tokens. Needs torch,
transformers, tokenizers and safetensors (all in a vLLM environment).
"""

from __future__ import annotations

import json
import os

LLAMA = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)

_CORPUS = [
    "the memory broker lends pages of one arena to every engine on the machine",
    "a key covers the model the adapter the dtype and the block of tokens",
    "two engines share the prefix of a long system prompt through one broker",
    "an engine killed and started again finds its cache still in the pages",
    "greedy decoding gives the same tokens with and without the connector",
    "0 1 2 3 4 5 6 7 8 9 a b c d e f g h i j k l m n o p q r s t u v w x y z",
]


# Big enough that a 1k-token prefill costs real time on a CPU (the benchmark's model):
# about 26M parameters, 512 KiB of float32 KV per 32-token block.
SMALL = dict(
    LLAMA, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4
)


def build(path: str, seed: int = 0, config: dict | None = None) -> str:
    """Write the model (config, safetensors weights, tokenizer) to ``path``; idempotent.
    ``config``: LlamaConfig fields (default ``LLAMA``, the tests' model; ``SMALL`` for timing)."""
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=LLAMA["vocab_size"], special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    torch.manual_seed(seed)
    cfg = LlamaConfig(**(config or LLAMA), bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue
            p.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


def build_lora(
    path: str, seed: int, rank: int = 8, alpha: float = 16.0, bf16_exact: bool = False, config: dict | None = None
) -> str:
    """Write a PEFT LoRA adapter (q/k/v/o projections, random A and B) for ``build``'s model.
    ``bf16_exact``: float32 weights that bfloat16 holds exactly (a broker storing adapters in
    bfloat16 then serves the very weights a float32 engine reads from the file). ``config``: the
    model's LlamaConfig fields, as given to ``build`` (default ``LLAMA``)."""
    if os.path.exists(os.path.join(path, "adapter_model.safetensors")):
        return path
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(1000 + seed)
    cfg = config or LLAMA
    hidden = cfg["hidden_size"]
    kv = hidden // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    outs = {"q_proj": hidden, "k_proj": kv, "v_proj": kv, "o_proj": hidden}
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for mod, out in outs.items():
            pre = f"base_model.model.model.layers.{layer}.self_attn.{mod}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, hidden, generator=g) * 0.3
            tensors[f"{pre}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.3
    if bf16_exact:
        tensors = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in tensors.items()}
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": rank,
                "lora_alpha": alpha,
                "target_modules": sorted(outs),
                "lora_dropout": 0.0,
                "bias": "none",
                "use_rslora": False,
                "use_dora": False,
                "fan_in_fan_out": False,
                "base_model_name_or_path": None,
                "modules_to_save": None,
            },
            f,
        )
    return path
