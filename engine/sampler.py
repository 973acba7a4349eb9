"""Next-token choice for the rows that sample this step.

Rows with penalties, a logit bias or min_tokens first have their logits adjusted (`process`),
element by element from the row's own token history, so a row stays independent of its batch.
Greedy rows take the argmax of fp32 logits. Sampled rows apply temperature, top-k and top-p,
then draw with the exponential-race trick (argmax of p / Exp(1) noise is a draw from p) where
the noise of a row comes from a generator seeded by (request seed, output index): a request's
tokens depend on its own logits and seed only, never on what else is in the batch or on how
many times it was preempted.
"""

import logging
from collections.abc import Sequence

import torch

from engine.sampling import SamplingParams

log = logging.getLogger("inherent.engine")

# A row's token history: all its token ids (prompt, then output) and how many are the prompt.
History = tuple[Sequence[int], int]


def row_seed(seed: int, output_index: int) -> int:
    return hash((seed, output_index))  # deterministic for ints, whatever PYTHONHASHSEED says


# The token of a row whose sampling raised: the engine ends that request with an error.
SAMPLING_FAILED = -1


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.generator = torch.Generator()
        self.eos_token_ids = tuple(eos_token_ids)  # masked while a row is below min_tokens

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
        output_indices: list[int], histories: list[History] | None = None,
    ) -> list[int]:
        """`logits` [B, vocab]; one params / seed / output index per row; `histories` (one
        per row) are needed when a row has penalties. If the batch fails, each row is sampled
        alone (rows are independent, so the tokens are the same), and a row that still fails
        gets SAMPLING_FAILED: one request's failure never ends the others."""
        try:
            return self.sample(logits, params, seeds, output_indices, histories)
        except Exception:
            log.exception("sampling failed for the batch; sampling its rows one by one")
        tokens = []
        for i in range(len(params)):
            try:
                tokens += self.sample(logits[i : i + 1], params[i : i + 1], seeds[i : i + 1],
                                      output_indices[i : i + 1],
                                      histories[i : i + 1] if histories is not None else None)
            except Exception:
                log.exception("sampling failed for one request")
                tokens.append(SAMPLING_FAILED)
        return tokens

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
        output_indices: list[int], histories: list[History] | None = None,
    ) -> list[int]:
        logits = logits.float()
        processed = [i for i, p in enumerate(params) if p.processes_logits(output_indices[i])]
        if processed:
            logits = logits.clone()  # never write into the caller's (the model's) logits
            logits[processed] = process(
                logits[processed], [params[i] for i in processed],
                [output_indices[i] for i in processed],
                [histories[i] for i in processed] if histories is not None else None,
                self.eos_token_ids,
            )
        # numpy's argmax is vectorized; torch's CPU argmax reduction is ~20x slower here.
        tokens = logits.cpu().numpy().argmax(axis=1).tolist()  # the greedy rows keep theirs
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled_rows:
            return tokens
        rows = [params[i] for i in sampled_rows]
        x = logits[sampled_rows]
        device = x.device
        x.div_(torch.tensor([p.temperature for p in rows], device=device).unsqueeze(1))
        probs = x.softmax(dim=-1)
        if any(p.top_k or p.top_p < 1.0 for p in rows):
            probs = truncate(probs, rows)
        # Noise is drawn in vocabulary order, so a row's draw never depends on other rows; on
        # the host (a CPU generator), so it is the same whatever device holds the logits.
        noise = torch.empty(probs.shape, dtype=probs.dtype)
        g = self.generator
        for r, i in enumerate(sampled_rows):
            g.manual_seed(row_seed(seeds[i], output_indices[i]))
            noise[r].exponential_(generator=g)
        noise = noise.to(device)
        # A zero draw would turn p / 0 into inf (or 0 / 0 into NaN for a truncated token).
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        choice = probs.div_(noise).cpu().numpy().argmax(axis=1)
        for i, token in zip(sampled_rows, choice.tolist(), strict=True):
            tokens[i] = token
        return tokens


def truncate(probs: torch.Tensor, rows: list[SamplingParams]) -> torch.Tensor:
    """Zero the tokens outside each row's top-k and top-p sets (rows without either are
    unchanged: their cut-offs keep every token)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    vocab, device = probs.shape[1], probs.device
    top_k = torch.tensor([p.top_k or vocab for p in rows], device=device).unsqueeze(1)
    # top_p = 1 must keep every token even where the float cumsum rounds up to 1.
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in rows],
                         device=device).unsqueeze(1)
    # Keep a token while the mass before it is below top_p (the first always stays).
    drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
    drop |= torch.arange(vocab, device=device).unsqueeze(0) >= top_k
    return probs.scatter(1, order, sorted_probs.masked_fill_(drop, 0.0))


def process(
    x: torch.Tensor, rows: list[SamplingParams], output_indices: list[int],
    histories: list[History] | None, eos_token_ids: Sequence[int],
) -> torch.Tensor:
    """Penalties, logit bias and the min_tokens mask on `x` [R, vocab] (one row per params),
    as whole-tensor element-wise ops: each element depends on its own row only."""
    rows_n, vocab = x.shape

    def tensor(values, dtype=torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=x.device)

    if any(p.penalized for p in rows):
        if histories is None:
            raise ValueError("penalties need each row's token history")
        # Flat indices (row * vocab + token) of every token seen, and of every output token.
        seen = torch.cat([torch.as_tensor(ids, dtype=torch.int64) + r * vocab
                          for r, (ids, _) in enumerate(histories)]).to(x.device)
        out = torch.cat([torch.as_tensor(ids[n:], dtype=torch.int64) + r * vocab
                         for r, (ids, n) in enumerate(histories)]).to(x.device)
        counts = torch.zeros(rows_n * vocab, device=x.device)
        counts.index_add_(0, out, torch.ones(len(out), device=x.device))
        counts = counts.view(rows_n, vocab)  # exact: float32 counts integers up to 2**24
        present = torch.zeros(rows_n * vocab, dtype=torch.bool, device=x.device)
        present[seen] = True
        present = present.view(rows_n, vocab)
        rep = tensor([p.repetition_penalty for p in rows]).unsqueeze(1)
        x = torch.where(present, torch.where(x > 0, x / rep, x * rep), x)
        freq = tensor([p.frequency_penalty for p in rows]).unsqueeze(1)
        pres = tensor([p.presence_penalty for p in rows]).unsqueeze(1)
        x = x - freq * counts - pres * (counts > 0).float()
    biased = [(r, t, b) for r, p in enumerate(rows) for t, b in p.logit_bias.items()]
    if biased:
        r, t, b = zip(*biased, strict=True)
        x = x.index_put((tensor(r, torch.int64), tensor(t, torch.int64)), tensor(b),
                        accumulate=True)
    masked = [(r, t) for r, (p, i) in enumerate(zip(rows, output_indices, strict=True))
              if i < p.min_tokens for t in (*eos_token_ids, *p.stop_token_ids)]
    if masked:
        r, t = zip(*masked, strict=True)
        x = x.index_put((tensor(r, torch.int64), tensor(t, torch.int64)),
                        tensor(float("-inf")))
    return x


def token_logprobs(
    logits: torch.Tensor, tokens: list[int], k: list[int]
) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """For each row of `logits` [R, vocab]: its chosen token, that token's log-probability and its
    `k` most likely tokens with theirs, under the model's raw distribution (log-softmax of the
    fp32 logits; torch computes it row by row on CPU, so a row's values do not depend on its
    batch)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(tokens, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, index).squeeze(1).tolist()
    width = max(k, default=0)
    top_values, top_ids = (logprobs.topk(width, dim=-1) if width else (None, None))
    return [
        (tokens[r], chosen[r], list(zip(top_ids[r, :n].tolist(), top_values[r, :n].tolist(), strict=True))
         if n else [])
        for r, n in enumerate(k)
    ]
