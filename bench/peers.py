"""PyTorch peers for bench.e2e: the same model and shapes as a Tessera bench spec, run by Hugging Face
`transformers` on the same GPU, in a process of their own (JAX's allocator holds most of the card in the
parent; bench.e2e runs the peers before it starts JAX).

    python -m bench.peers llama_train specs/bench/llama_1b_train.yaml [--eager] [--steps 10] [--device cuda]

Prints one line `RESULT {json}`: tokens/s, the median step in ms and the peak memory PyTorch's allocator saw.
The Llama train step is what the issue's peer row names: fp32 master weights, bf16 autocast, SDPA attention,
fused AdamW, `torch.compile` unless --eager; loss over the shifted tokens as `transformers` computes it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _llama_config(args: dict, seq: int):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=int(args["vocab"]), hidden_size=int(args["d_model"]), intermediate_size=int(args["d_ff"]),
        num_hidden_layers=int(args["layers"]), num_attention_heads=int(args["heads"]),
        num_key_value_heads=int(args["kv_heads"]), head_dim=int(args["head_dim"]),
        rope_theta=float(args.get("rope_theta", 10000.0)), rms_norm_eps=float(args.get("norm_eps", 1e-5)),
        tie_word_embeddings=bool(args.get("tie_embeddings", False)), max_position_embeddings=seq,
        attn_implementation="sdpa")


def llama_train(model_args: dict, batch: int, seq: int, *, compiled: bool, steps: int = 10, warmup: int = 3,
                device: str = "cuda") -> dict:
    """One `transformers` Llama optimizer step timed `steps` times after `warmup` (compile included there)."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config(model_args, seq)).to(device)  # fp32 master weights
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=device == "cuda")
    run = torch.compile(model) if compiled else model
    tokens = torch.randint(0, int(model_args["vocab"]), (batch, seq), device=device)
    kind = "cuda" if device.startswith("cuda") else "cpu"

    def step():
        with torch.autocast(device_type=kind, dtype=torch.bfloat16):
            loss = run(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if kind == "cuda" else (lambda: None)
    start = time.perf_counter()
    for _ in range(max(warmup, 1)):
        loss = step()
    sync()
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - start)
    med = statistics.median(times)
    return {"peer": f"transformers {transformers.__version__} + torch {torch.__version__}"
                    + (" compile" if compiled else " eager"),
            "tokens_per_s": batch * seq / med, "step_ms": med * 1e3, "warmup_s": first, "loss": float(loss.detach()),
            "peak_bytes": torch.cuda.max_memory_allocated() if kind == "cuda" else None}


PEERS = {"llama_train": llama_train}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("peer", choices=sorted(PEERS))
    parser.add_argument("spec", help="the Tessera bench spec whose model and shapes the peer runs")
    parser.add_argument("--eager", action="store_true", help="no torch.compile")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    from tessera.spec import load_experiment  # the spec only: this process never starts JAX's backend

    exp = load_experiment(args.spec, overrides=args.overrides)
    result = PEERS[args.peer](dict(exp.model.args), int(exp.task.batch), int(exp.task.seq_len),
                              compiled=not args.eager, steps=args.steps, device=args.device)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
