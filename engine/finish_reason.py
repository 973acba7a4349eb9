"""Why a request ended. The values are what the API, the receipts and the metrics carry."""

from enum import StrEnum


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # cancelled, failed, or lost with a worker
