"""Train the in-context-bigram decoder shipped as `induction-2l` (method note §4; Bietti et al. 2023).

Every sequence draws `n_distinct` distinct tokens out of `vocab` and a random successor map over them (each of
the tokens gets a successor drawn uniformly from them), then walks it for `seq_len` tokens after BOS, jumping to a
uniformly drawn one of the tokens with probability `jump_prob` at every step. The next token is predictable only
in context: from what followed the current token earlier. The loss counts predicted tokens at positions
>= `loss_from`. A 2-layer GPT-2 learns this with the induction circuit of Olsson et al. 2022 after a loss plateau:
a previous-token head in layer 0 whose output the layer-1 heads read with their keys.

The circuit is measured from the model's own attention (eager attention, `output_attentions=True`) on a fixed
evaluation set: a head's previous-token attention is its mean attention on key q-1 over queries q >= 1; its
induction attention is its mean mass on the keys k < q whose preceding token equals the query token, over the
queries that have such a key. Checkpoints at `checkpoints` and the final model are written as
`<out>/<name>-step<N>` and `<out>/<name>`, each with config.json, model.safetensors, a WordLevel tokenizer and a
model card README.md. The tokenizer names the `vocab` tokens the walks draw from "t0".."t<vocab-2>" and <unk>,
then <bos>: text outside that vocabulary (e.g. the IOI prompts of headgraph's role tests) becomes <unk>, a
token trained like the others rather than an untrained embedding.

Deterministic on the CPU: torch.manual_seed(seed) for the weights, torch.Generator seeds for the data.

    python scripts/train_induction.py                      # writes headgraph/data/models/induction-2l*
    python scripts/train_induction.py --steps 2000 --out /tmp/models --checkpoints 500,1000
"""

import argparse
import itertools
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from tokenizers.processors import TemplateProcessing
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

BOS_TOKEN, UNK_TOKEN = "<bos>", "<unk>"


@dataclass(frozen=True)
class Config:
    seed: int = 0
    vocab: int = 64  # tokens the walks draw from: t0..t62 and <unk> (id 63); <bos> is id 64
    n_distinct: int = 12
    seq_len: int = 48  # tokens after BOS
    jump_prob: float = 0.25
    loss_from: int = 16
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    d_mlp: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.01
    batch_size: int = 32
    steps: int = 6000  # past ~6k steps one layer-1 head drifts towards uniform attention over the context
    checkpoints: tuple[int, ...] = (2000, 3000, 4000)  # before, during and after the phase change (seed 0)
    eval_every: int = 250
    eval_size: int = 512
    threads: int = 2
    name: str = "induction-2l"
    out: Path = Path(__file__).resolve().parents[1] / "headgraph" / "data" / "models"


def parse_config() -> Config:
    """Config with the command line's overrides (`--steps 2000`, `--checkpoints 500,1000`, ...)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in fields(Config):
        default = getattr(Config, f.name)
        kind = (lambda s: tuple(int(x) for x in s.split(","))) if isinstance(default, tuple) else type(default)
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=default)
    return Config(**vars(parser.parse_args()))


def sample_batch(cfg: Config, n: int, gen: torch.Generator) -> torch.Tensor:
    """n sequences [n, 1 + seq_len]: BOS, then a walk on a random successor map over n_distinct tokens."""
    tokens = torch.rand(n, cfg.vocab, generator=gen).argsort(-1)[:, : cfg.n_distinct]
    successor = torch.randint(cfg.n_distinct, (n, cfg.n_distinct), generator=gen)
    jump = torch.rand(n, cfg.seq_len, generator=gen) < cfg.jump_prob
    fresh = torch.randint(cfg.n_distinct, (n, cfg.seq_len), generator=gen)
    state = fresh.clone()
    for t in range(1, cfg.seq_len):
        follow = successor.gather(1, state[:, t - 1 : t]).squeeze(1)
        state[:, t] = torch.where(jump[:, t], fresh[:, t], follow)
    return torch.cat([torch.full((n, 1), cfg.vocab), tokens.gather(1, state)], dim=1)


def labels_for(cfg: Config, ids: torch.Tensor) -> torch.Tensor:
    """Next-token labels (GPT2LMHeadModel shifts them): tokens before `loss_from` are ignored."""
    labels = ids.clone()
    labels[:, : cfg.loss_from] = -100
    return labels


def build_model(cfg: Config) -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=cfg.vocab + 1, n_positions=1 + cfg.seq_len, n_embd=cfg.d_model, n_layer=cfg.n_layer,
        n_head=cfg.n_head, n_inner=cfg.d_mlp, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=cfg.vocab, eos_token_id=cfg.vocab, pad_token_id=cfg.vocab,
    )
    config._attn_implementation = "eager"
    return GPT2LMHeadModel(config)


def build_tokenizer(cfg: Config) -> PreTrainedTokenizerFast:
    """WordLevel tokenizer: "t0".."t<vocab-2>" are ids 0..vocab-2, <unk> (any other word) vocab-1, <bos> vocab."""
    vocab = {f"t{i}": i for i in range(cfg.vocab - 1)} | {UNK_TOKEN: cfg.vocab - 1, BOS_TOKEN: cfg.vocab}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.post_processor = TemplateProcessing(single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, cfg.vocab)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS_TOKEN, eos_token=BOS_TOKEN,
                                   pad_token=BOS_TOKEN, unk_token=UNK_TOKEN, model_max_length=1 + cfg.seq_len)


@torch.no_grad()
def measure(cfg: Config, model: GPT2LMHeadModel, ids: torch.Tensor) -> dict:
    """Loss and each head's previous-token and induction attention [layer][head] on the evaluation set."""
    model.eval()
    out = model(ids, labels=labels_for(cfg, ids), output_attentions=True)
    model.train()
    att = torch.stack(out.attentions, dim=1)  # [batch, layer, head, query, key]
    previous = att.diagonal(offset=-1, dim1=-2, dim2=-1).mean((0, -1))
    before = torch.cat([torch.full_like(ids[:, :1], -1), ids[:, :-1]], dim=1)
    earlier = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril(-1)
    sieve = (ids[:, :, None] == before[:, None, :]) & earlier
    scored = sieve.any(-1)
    mass = torch.einsum("blhqk,bqk->blhq", att, sieve.float())
    induction = (mass * scored[:, None, None]).sum((0, -1)) / scored.sum()
    return {"loss": out.loss.item(), "previous": previous.tolist(), "induction": induction.tolist()}


def phase_change(curve: list[tuple[int, dict]]) -> str:
    """The first evaluation at which both halves of the circuit pass 0.5 attention, with the loss around it."""
    for (s0, m0), (s1, m1) in itertools.pairwise(curve):
        if max(m1["previous"][0]) > 0.5 and sum(m1["induction"][1]) / len(m1["induction"][1]) > 0.5:
            return (f"the first evaluation at which the best layer-0 previous-token attention and the mean layer-1 "
                    f"induction attention both exceed 0.5 is step {s1} (eval loss {m0['loss']:.3f} at step {s0}, "
                    f"{m1['loss']:.3f} at step {s1})")
    return "no evaluation has both the best layer-0 previous-token and the mean layer-1 induction attention above 0.5"


def head_table(m: dict) -> list[str]:
    rows = ["| head | previous-token | induction |", "|---|---|---|"]
    for layer, (prev, ind) in enumerate(zip(m["previous"], m["induction"])):
        rows += [f"| L{layer}H{h} | {p:.3f} | {i:.3f} |" for h, (p, i) in enumerate(zip(prev, ind))]
    return rows


def model_card(cfg: Config, folder: str, curve: list[tuple[int, dict]], saved: dict[str, tuple[int, dict]]) -> str:
    step, _ = saved[folder]
    recipe = "\n".join(f"| {k} | {', '.join(map(str, v)) if isinstance(v, tuple) else v} |"
                       for k, v in asdict(cfg).items() if k != "out")
    lines = [
        f"# {folder}", "",
        (f"`{folder}`: the in-context-bigram decoder `{cfg.name}` after {step} of its {cfg.steps} training steps "
         f"(method note §4, Bietti et al. 2023), written by `scripts/train_induction.py` on the CPU. GPT-2, "
         f"{cfg.n_layer} layers x {cfg.n_head} heads, d_model {cfg.d_model}, MLP {cfg.d_mlp}, no dropout, learned "
         f"positions, n_ctx {1 + cfg.seq_len}; vocabulary t0..t{cfg.vocab - 2} and {UNK_TOKEN} "
         f"(id {cfg.vocab - 1}, any word outside the vocabulary; trained like the t tokens), then {BOS_TOKEN} "
         f"(id {cfg.vocab}, also EOS and padding)."),
        "",
        ("Data: every sequence is BOS, then a walk of `seq_len` tokens on a random successor map over "
         "`n_distinct` distinct tokens, with a uniform jump among them with probability `jump_prob`; loss on "
         "predicted tokens at positions >= `loss_from`. AdamW; weights seeded with torch.manual_seed(seed), data "
         "with torch.Generator seeds seed (training) and seed + 1 (evaluation)."),
        "",
        "| setting | value |", "|---|---|", recipe, "",
        "## Attention measured on the evaluation set", "",
        (f"{cfg.eval_size} fresh sequences, eager attention. previous-token: mean attention on key q-1 over "
         "queries q >= 1. induction: mean attention mass on the keys k < q whose preceding token is the query "
         "token, over the queries that have such a key."), "",
    ]
    for name, (s, m) in saved.items():
        lines += [f"### `{name}` (step {s}, loss {m['loss']:.3f} nats)", "", *head_table(m), ""]
    lines += ["## Training curve", "", f"Phase change: {phase_change(curve)}.", "",
              "| step | eval loss (nats) | best layer-0 previous-token | mean layer-1 induction |", "|---|---|---|---|"]
    lines += [f"| {s} | {m['loss']:.3f} | {max(m['previous'][0]):.3f} | "
              f"{sum(m['induction'][1]) / cfg.n_head:.3f} |" for s, m in curve]
    return "\n".join(lines) + "\n"


def save(model: GPT2LMHeadModel, tokenizer: PreTrainedTokenizerFast, folder: Path) -> None:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def main() -> None:
    cfg = parse_config()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    train_gen = torch.Generator().manual_seed(cfg.seed)
    eval_ids = sample_batch(cfg, cfg.eval_size, torch.Generator().manual_seed(cfg.seed + 1))
    model = build_model(cfg)
    tokenizer = build_tokenizer(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    curve, saved = [(0, measure(cfg, model, eval_ids))], {}
    start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        ids = sample_batch(cfg, cfg.batch_size, train_gen)
        loss = model(ids, labels=labels_for(cfg, ids)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % cfg.eval_every == 0 or step in cfg.checkpoints or step == cfg.steps:
            m = measure(cfg, model, eval_ids)
            curve.append((step, m))
            print(f"step {step:5d}  train {loss.item():.3f}  eval {m['loss']:.3f}  "
                  f"L0 previous-token {max(m['previous'][0]):.3f}  L1 induction {min(m['induction'][1]):.3f}-"
                  f"{max(m['induction'][1]):.3f}  {time.perf_counter() - start:.0f} s", flush=True)
        if step in cfg.checkpoints or step == cfg.steps:
            folder = cfg.name if step == cfg.steps else f"{cfg.name}-step{step}"
            save(model, tokenizer, cfg.out / folder)
            saved[folder] = (step, curve[-1][1])
    for folder in saved:
        (cfg.out / folder / "README.md").write_text(model_card(cfg, folder, curve, saved))
        print(f"wrote {cfg.out / folder}")


if __name__ == "__main__":
    main()
