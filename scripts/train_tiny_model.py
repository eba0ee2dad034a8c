"""Train the tiny TinyStories Llama that ships with the project as its default model.

The engine needs a real model that is small enough to commit and to run in tests without a
network. This script makes one from scratch on a CPU: it trains a byte-level BPE tokenizer and a
small LlamaForCausalLM (GQA, RoPE, tied embeddings) on the TinyStories subset, measures it on
held-out stories, and writes a Hugging Face model directory together with its model card.
Every number in the card comes from the run itself, so rerunning the recorded command
regenerates the card.
"""

import argparse
import json
import math
import platform
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO_ROOT.parent / "shared" / "data" / "tinystories" / "tinystories.txt"
DEFAULT_OUT = REPO_ROOT / "assets" / "models" / "tinystories-llama"
EOT = "<|endoftext|>"
STORY_SEPARATOR = f"\n{EOT}\n"
SAMPLE_PROMPTS = ("Once upon a time", "Lily wanted to", "The little dog")
TRAIN_LOSS_WINDOW = 50


@dataclass
class TrainResult:
    """What the training loop measured, for the model card and metrics.json."""

    steps: int
    tokens_seen: int
    epochs: float
    final_train_loss: float
    train_seconds: float
    stopped_by_time: bool


@dataclass
class EvalResult:
    """Validation numbers; bits per byte makes them comparable across tokenizers."""

    loss: float
    bits_per_byte: float
    tokens: int
    bytes: int


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Keep every knob on the command line so the recorded command reproduces the run."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="TinyStories text file")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output model directory")
    p.add_argument("--train-stories", type=int, default=5431, help="first N stories train")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=576)
    p.add_argument("--max-position-embeddings", type=int, default=2048)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--block-size", type=int, default=512, help="training context length")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=1800, help="optimizer steps (sets the LR schedule)")
    p.add_argument("--max-minutes", type=float, default=62.0, help="hard cap on training time")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr", type=float, default=2e-4)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-batch-size", type=int, default=16)
    p.add_argument("--sample-tokens", type=int, default=60, help="new tokens per card sample")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--trial-metrics",
        type=Path,
        help="metrics.json of an earlier shorter run; only adds a comparison to the card",
    )
    return p.parse_args(argv)


def load_stories(path: Path) -> list[str]:
    """Split the corpus on its story separator; the file ends with one, so drop empties."""
    text = path.read_text(encoding="utf-8")
    return [story for story in text.split(STORY_SEPARATOR) if story]


def train_tokenizer(stories: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE, so any UTF-8 text round-trips, with EOT as id 0 and prepended as BOS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(stories, trainer=trainer)
    eot_id = tok.token_to_id(EOT)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A",
        pair=f"{EOT} $A {EOT} $B:1",
        special_tokens=[(EOT, eot_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )


def encode_stream(tokenizer: PreTrainedTokenizerFast, stories: list[str]) -> torch.Tensor:
    """Encode as `EOT story EOT story ... EOT`: each story opens with BOS and ends with EOS."""
    ids = [i for encoded in tokenizer(stories)["input_ids"] for i in encoded]
    ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def make_windows(stream: torch.Tensor, block_size: int, keep_tail: bool) -> list[torch.Tensor]:
    """Cut the stream into windows of block_size+1 sharing one token at each seam.

    Inputs are window[:-1] and targets window[1:], so every token after the first is a target
    exactly once and no prediction is lost at block boundaries.
    """
    starts = range(0, len(stream) - 1, block_size)
    windows = [stream[s : s + block_size + 1] for s in starts]
    if not keep_tail and len(windows[-1]) < block_size + 1:
        windows.pop()
    return windows


def build_model(args: argparse.Namespace, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A Llama small enough for a CPU, keeping GQA and RoPE so the engine exercises them."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden_size // args.heads,
        max_position_embeddings=args.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to min_lr at the last step."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return args.min_lr + (args.lr - args.min_lr) * cosine


def make_optimizer(model: LlamaForCausalLM, args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only; decaying norms and biases only hurts."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def batches(windows: list[torch.Tensor], batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Yield batches forever, reshuffling the windows every epoch with a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(windows), generator=gen).tolist()
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield torch.stack([windows[j] for j in order[i : i + batch_size]])


def next_token_loss(model: LlamaForCausalLM, window: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting window[:, 1:] from window[:, :-1]."""
    logits = model(input_ids=window[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())


def train(model: LlamaForCausalLM, windows: list[torch.Tensor], args: argparse.Namespace) -> TrainResult:
    """Run the schedule, stopping early only if --max-minutes is reached."""
    optimizer = make_optimizer(model, args)
    data = batches(windows, args.batch_size, args.seed)
    recent: list[float] = []
    start = time.monotonic()
    deadline = start + args.max_minutes * 60
    step = 0
    model.train()
    bar = tqdm(range(args.steps), desc="train", dynamic_ncols=True)
    for step in bar:
        if time.monotonic() > deadline:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        loss = next_token_loss(model, next(data))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        recent = (recent + [loss.item()])[-TRAIN_LOSS_WINDOW:]
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr_at(step, args):.1e}")
    else:
        step = args.steps
    bar.close()
    tokens = step * args.batch_size * args.block_size
    return TrainResult(
        steps=step,
        tokens_seen=tokens,
        epochs=tokens / (len(windows) * args.block_size),
        final_train_loss=sum(recent) / len(recent),
        train_seconds=time.monotonic() - start,
        stopped_by_time=step < args.steps,
    )


@torch.no_grad()
def evaluate(
    model: LlamaForCausalLM,
    stream: torch.Tensor,
    stories: list[str],
    args: argparse.Namespace,
) -> EvalResult:
    """Score every validation token after the leading EOT, once each.

    The targets are each story's tokens followed by its closing EOT, so the nats include
    predicting where stories end, while the byte count covers only the story text: the
    bits per byte are, if anything, slightly pessimistic.
    """
    model.eval()
    windows = make_windows(stream, args.block_size, keep_tail=True)
    total_nats = 0.0
    for i in tqdm(range(0, len(windows), args.eval_batch_size), desc="eval", dynamic_ncols=True):
        group = windows[i : i + args.eval_batch_size]
        for length in sorted({len(w) for w in group}):
            same = torch.stack([w for w in group if len(w) == length])
            total_nats += next_token_loss(model, same).item() * same[:, 1:].numel()
    tokens = len(stream) - 1
    n_bytes = sum(len(story.encode("utf-8")) for story in stories)
    return EvalResult(
        loss=total_nats / tokens,
        bits_per_byte=total_nats / math.log(2) / n_bytes,
        tokens=tokens,
        bytes=n_bytes,
    )


@torch.no_grad()
def greedy_samples(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, n_new: int) -> list[tuple[str, str]]:
    """Greedy continuations for the card: deterministic, so readers can check them."""
    model.eval()
    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        out = model.generate(input_ids=ids, do_sample=False, max_new_tokens=n_new)
        samples.append((prompt, tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)))
    return samples


def cpu_name() -> str:
    """Name the CPU in the card, since training time depends on it."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def trial_paragraph(path: Path | None, val: EvalResult) -> str:
    """Compare with an earlier shorter run, so the card shows what the longer training bought."""
    if path is None:
        return ""
    trial = json.loads(path.read_text())
    tr = trial["train"]
    return f"""
## Shorter trial run

A {tr["steps"]:,}-step trial ({tr["tokens_seen"]:,} tokens, {tr["train_seconds"] / 60:.1f} min of training), run with

```
{trial["command"]}
```

reached validation bits per byte {trial["val"]["bits_per_byte"]:.4f} (loss {trial["val"]["loss"]:.4f} nats/token);
this run reaches {val.bits_per_byte:.4f} (loss {val.loss:.4f}). The trial's `metrics.json` is passed to this run with
`--trial-metrics`, which only adds this section to the card.
"""


def model_card(facts: dict, trial: str) -> str:
    """Render README.md from measured numbers only."""
    tr, val, cfg = facts["train"], facts["val"], facts["config"]
    samples = "\n".join(f"Prompt `{prompt}`:\n\n```\n{prompt}{text}\n```\n" for prompt, text in facts["samples"])
    stop_note = " (stopped early by --max-minutes)" if tr["stopped_by_time"] else ""
    return f"""---
license: cdla-sharing-1.0
language: en
library_name: transformers
pipeline_tag: text-generation
datasets:
- roneneldan/TinyStories
---

# tinystories-llama

A tiny `LlamaForCausalLM` trained from scratch on a subset of TinyStories. It is the project's embedded default
model: small enough to commit and to run offline in tests, while still writing simple English stories.

Parameters: {facts["parameters"]:,}

## Data

TinyStories (Ronen Eldan and Yuanzhi Li, 2023, "TinyStories: How Small Can Language Models Be and Still Speak
Coherent English?", arXiv:2305.07759), a subset of {facts["stories_total"]:,} stories, licensed CDLA-Sharing-1.0.
The first {facts["stories_train"]:,} stories trained the tokenizer and the model; the last {facts["stories_val"]:,}
stories were held out for validation. The trained weights are "Results" under CDLA-Sharing-1.0, which puts no
conditions on them. The data itself is not included here.

## Architecture

- `LlamaForCausalLM`: {cfg["num_hidden_layers"]} layers, hidden size {cfg["hidden_size"]},
  SwiGLU MLP size {cfg["intermediate_size"]}
- Attention: {cfg["num_attention_heads"]} query heads, {cfg["num_key_value_heads"]} key/value heads (GQA),
  head dim {cfg["head_dim"]}
- RoPE (theta {cfg["rope_theta"]:g}), max_position_embeddings {cfg["max_position_embeddings"]};
  trained on {facts["block_size"]}-token blocks
- Tied input/output embeddings, vocabulary {cfg["vocab_size"]:,}
- Tokenizer: byte-level BPE trained on the training split. `{EOT}` (id {facts["eot_id"]}) is BOS, EOS and pad,
  and the tokenizer prepends it as BOS. Each training story was encoded as `{EOT} story`, so the model
  emits `{EOT}` when a story ends.

## Training

- Hardware: {facts["hardware"]}
- Training time: {tr["train_seconds"] / 60:.1f} min wall; {facts["total_seconds"] / 60:.1f} min for the whole script
  (tokenizer training, evaluation and samples included)
- Steps: {tr["steps"]:,}{stop_note}, batch {facts["batch_size"]} x {facts["block_size"]} tokens,
  {tr["tokens_seen"]:,} tokens seen ({tr["epochs"]:.2f} epochs of {facts["train_tokens"]:,} training tokens)
- AdamW (betas 0.9/0.95, weight decay {facts["weight_decay"]}), peak LR {facts["lr"]:g},
  {facts["warmup_steps"]} warm-up steps, cosine decay to {facts["min_lr"]:g}, grad clip {facts["grad_clip"]},
  fp32, seed {facts["seed"]}

## Results

- Final train loss (mean of the last {TRAIN_LOSS_WINDOW} steps): {tr["final_train_loss"]:.4f} nats/token
- Validation loss: {val["loss"]:.4f} nats/token over {val["tokens"]:,} tokens
- Validation bits per byte: {val["bits_per_byte"]:.4f} (total nats / ln 2 / {val["bytes"]:,} UTF-8 bytes of story text;
  the nats also include predicting each story's closing `{EOT}`)
{trial}
## Greedy samples

{facts["sample_tokens"]} new tokens after each prompt, `do_sample=False`:

{samples}
## Reproduce

From the repository root (the TinyStories file lives outside the repository):

```
{facts["command"]}
```
"""


def save(out: Path, model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast) -> None:
    """Write safetensors weights, the tokenizer and a generation config with all special ids."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.bin"):
        stale.unlink()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def main(argv: list[str]) -> None:
    """Train, evaluate, save, and describe the model."""
    args = parse_args(argv)
    start = time.monotonic()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    stories = load_stories(args.data)
    train_stories, val_stories = stories[: args.train_stories], stories[args.train_stories :]
    tokenizer = train_tokenizer(train_stories, args.vocab_size)
    train_stream = encode_stream(tokenizer, train_stories)
    val_stream = encode_stream(tokenizer, val_stories)
    print(f"stories {len(train_stories)} / {len(val_stories)}, tokens {len(train_stream):,} / {len(val_stream):,}")

    model = build_model(args, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters {n_params:,}")
    result = train(model, make_windows(train_stream, args.block_size, keep_tail=False), args)
    val = evaluate(model, val_stream, val_stories, args)
    print(f"train loss {result.final_train_loss:.4f}  val loss {val.loss:.4f}  val bpb {val.bits_per_byte:.4f}")
    samples = greedy_samples(model, tokenizer, args.sample_tokens)

    save(args.out, model, tokenizer)
    cfg = model.config
    facts = {
        "command": shlex.join(["python", "scripts/train_tiny_model.py", *argv]),
        "parameters": n_params,
        "stories_total": len(stories),
        "stories_train": len(train_stories),
        "stories_val": len(val_stories),
        "train_tokens": len(train_stream),
        "eot_id": tokenizer.eos_token_id,
        "hardware": f"{cpu_name()}, {args.threads} CPU threads ({platform.machine()}), no GPU",
        "config": {
            **{
                k: getattr(cfg, k)
                for k in (
                    "num_hidden_layers",
                    "hidden_size",
                    "intermediate_size",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "head_dim",
                    "max_position_embeddings",
                    "vocab_size",
                )
            },
            "rope_theta": args.rope_theta,
        },
        **{
            k: getattr(args, k)
            for k in (
                "block_size",
                "batch_size",
                "lr",
                "min_lr",
                "warmup_steps",
                "weight_decay",
                "grad_clip",
                "seed",
                "sample_tokens",
            )
        },
        "train": asdict(result),
        "val": asdict(val),
        "samples": samples,
        "total_seconds": time.monotonic() - start,
    }
    (args.out / "metrics.json").write_text(json.dumps(facts, indent=2) + "\n")
    (args.out / "README.md").write_text(model_card(facts, trial_paragraph(args.trial_metrics, val)))
    for prompt, text in samples:
        print(f"--- {prompt}{text}")


if __name__ == "__main__":
    main(sys.argv[1:])
