"""Next-token choice for the rows that sample this step.

Greedy rows take the argmax of fp32 logits. Sampled rows apply temperature, top-k and top-p,
then draw with the exponential-race trick (argmax of p / Exp(1) noise is a draw from p) where
the noise of a row comes from a generator seeded by (request seed, output index): a request's
tokens depend on its own logits and seed only, never on what else is in the batch or on how
many times it was preempted.
"""

import logging

import torch

from engine.sampling import SamplingParams

log = logging.getLogger("inherent.engine")


def row_seed(seed: int, output_index: int) -> int:
    return hash((seed, output_index))  # deterministic for ints, whatever PYTHONHASHSEED says


# The token of a row whose sampling raised: the engine ends that request with an error.
SAMPLING_FAILED = -1


class Sampler:
    def __init__(self) -> None:
        self.generator = torch.Generator()

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
        output_indices: list[int],
    ) -> list[int]:
        """`logits` [B, vocab]; one params / seed / output index per row. If the batch fails,
        each row is sampled alone (rows are independent, so the tokens are the same), and a row
        that still fails gets SAMPLING_FAILED: one request's failure never ends the others."""
        try:
            return self.sample(logits, params, seeds, output_indices)
        except Exception:
            log.exception("sampling failed for the batch; sampling its rows one by one")
        tokens = []
        for i in range(len(params)):
            try:
                tokens += self.sample(logits[i : i + 1], params[i : i + 1], seeds[i : i + 1],
                                      output_indices[i : i + 1])
            except Exception:
                log.exception("sampling failed for one request")
                tokens.append(SAMPLING_FAILED)
        return tokens

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
        output_indices: list[int],
    ) -> list[int]:
        logits = logits.float()
        # numpy's argmax is vectorized; torch's CPU argmax reduction is ~20x slower here.
        tokens = logits.cpu().numpy().argmax(axis=1).tolist()  # the greedy rows keep theirs
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled_rows:
            return tokens
        rows = [params[i] for i in sampled_rows]
        x = logits[sampled_rows]
        x.div_(torch.tensor([p.temperature for p in rows]).unsqueeze(1))
        probs = x.softmax(dim=-1)
        if any(p.top_k or p.top_p < 1.0 for p in rows):
            probs = truncate(probs, rows)
        # Noise is drawn in vocabulary order, so a row's draw never depends on other rows.
        noise = torch.empty_like(probs)
        g = self.generator
        for r, i in enumerate(sampled_rows):
            g.manual_seed(row_seed(seeds[i], output_indices[i]))
            noise[r].exponential_(generator=g)
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
    vocab = probs.shape[1]
    top_k = torch.tensor([p.top_k or vocab for p in rows]).unsqueeze(1)
    # top_p = 1 must keep every token even where the float cumsum rounds up to 1.
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in rows]).unsqueeze(1)
    # Keep a token while the mass before it is below top_p (the first always stays).
    drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
    drop |= torch.arange(vocab).unsqueeze(0) >= top_k
    return probs.scatter(1, order, sorted_probs.masked_fill_(drop, 0.0))
