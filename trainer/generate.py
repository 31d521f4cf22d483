"""Text generation with KV caches and the paper's adaptive-compute exit.

Decoding keeps keys and values per attention layer execution (`model.KVCache`): one entry each
for the prelude and coda blocks, and one per core block *per iteration*, because every iteration
of the recurrence attends with its own keys. Each new token runs the prelude once, iterates the
core up to `depth` times from a fresh random state s₀, and runs the coda once.

With `exit_threshold` ε, a token stops iterating once the latent state's relative change
‖sᵢ − sᵢ₋₁‖ / ‖sᵢ‖ falls below ε (the paper's latent-difference exit; not during the prompt). Later
tokens still attend to its keys at deeper iterations: it contributes the keys of its last
iteration there (the reference's "latest" cache lookup).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.errors import DataError, UserError
from trainer.export import load_any
from trainer.model import KVCache, RecurrentLM


@dataclass(frozen=True)
class Generation:
    text: str
    tokens: list[int]
    depths: list[int]  # core iterations each generated token used (the first: the prompt's)

    @property
    def mean_depth(self) -> float:
        return sum(self.depths) / len(self.depths) if self.depths else 0.0


def _reuse_last_iteration(
    cache: KVCache, model: RecurrentLM, used: int, depth: int, t: int
) -> None:
    """An exited token's keys at iterations used..depth-1 are those of its last iteration."""
    for block in range(len(model.core)):
        last = ("core", used - 1, block)
        k, v = cache.keys[last][:, :, -t:], cache.values[last][:, :, -t:]
        for iteration in range(used, depth):
            cache.extend(("core", iteration, block), k, v)


@torch.no_grad()
def decode(
    model: RecurrentLM,
    prompt: list[int],
    depth: int,
    max_new_tokens: int,
    exit_threshold: float | None = None,
    top_k: int = 0,
    temperature: float = 1.0,
    seed: int = 0,
) -> tuple[list[int], list[int]]:
    """(new token ids, core iterations used per new token). Deterministic for a seed."""
    if len(prompt) + max_new_tokens > model.cfg.max_seq_len + 1:
        raise UserError(
            f"prompt ({len(prompt)} tokens) + max_new_tokens={max_new_tokens} exceeds the "
            f"model's context of {model.cfg.max_seq_len}; shorten one of them"
        )
    model.eval()
    cache = KVCache()
    sampling = torch.Generator().manual_seed(seed)
    states = torch.Generator().manual_seed(seed + 1)
    chunk = torch.tensor([prompt])
    start = 0
    new: list[int] = []
    depths: list[int] = []
    for _ in range(max_new_tokens):
        t = chunk.shape[1]
        e = model.embed(chunk, start, cache)
        s = model.initial_state(e, generator=states)
        used = depth
        for iteration in range(depth):
            previous, s = s, model.core_step(s, e, t, start, cache, iteration)
            if exit_threshold is not None and start > 0:
                change = (s - previous).norm(dim=-1) / s.norm(dim=-1).clamp(min=1e-12)
                if float(change.max()) < exit_threshold:
                    used = iteration + 1
                    _reuse_last_iteration(cache, model, used, depth, t)
                    break
        logits = model.head(s, start, cache)[0, -1].float()
        if top_k == 0:
            token = int(logits.argmax())
        else:
            top = torch.topk(logits / temperature, min(top_k, logits.numel()))
            choice = torch.multinomial(top.values.softmax(-1), 1, generator=sampling)
            token = int(top.indices[choice])
        new.append(token)
        depths.append(used)
        start += t
        chunk = torch.tensor([[token]])
    return new, depths


def generate_text(
    checkpoint_or_export_dir: Path | str,
    prompt: str,
    depth: int,
    max_new_tokens: int = 32,
    tokenizer_path: Path | str | None = None,
    top_k: int = 0,
    temperature: float = 1.0,
    seed: int = 0,
    exit_threshold: float | None = None,
) -> Generation:
    """The continuation of `prompt` with at most `depth` core iterations per token.

    top_k = 0 decodes greedily; otherwise samples from the k most likely tokens. `seed` fixes both
    the sampling and the random initial states, so equal arguments give equal text.
    """
    from tokenizers import Tokenizer

    if depth < 1 or max_new_tokens < 0 or top_k < 0 or temperature <= 0:
        raise UserError(
            "generate needs depth >= 1, max_new_tokens >= 0, top_k >= 0 and temperature > 0"
        )
    if exit_threshold is not None and exit_threshold < 0:
        raise UserError(f"--exit-threshold must be >= 0, got {exit_threshold}")
    model, found_tokenizer = load_any(Path(checkpoint_or_export_dir))
    tokenizer_file = Path(tokenizer_path) if tokenizer_path is not None else found_tokenizer
    if tokenizer_file is None or not tokenizer_file.is_file():
        raise UserError(
            f"no tokenizer.json found for {checkpoint_or_export_dir}; pass --tokenizer FILE"
        )
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as error:  # tokenizers raises a bare Exception on a malformed file
        first_line = (str(error).splitlines() or [type(error).__name__])[0]
        raise DataError(
            f"{tokenizer_file} is not a valid tokenizer.json ({first_line or 'empty file'}); copy "
            "the dataset's tokenizer.json there or pass --tokenizer FILE"
        ) from None
    ids = tokenizer.encode(prompt).ids
    if not ids:
        raise UserError("the prompt encodes to no tokens; give a non-empty --prompt")
    if max(ids) >= model.cfg.vocab_size:
        raise UserError(f"{tokenizer_file} does not match the model's vocabulary")
    tokens, depths = decode(
        model, ids, depth, max_new_tokens, exit_threshold, top_k, temperature, seed
    )
    return Generation(tokenizer.decode(tokens), tokens, depths)
