"""OpenAI's embeddings endpoint on the embedding model that retrieval uses."""

import base64

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from gateway.deps import ChatPrincipal, ServicesDep
from gateway.errors import APIError
from gateway.schemas import EmbeddingRequest
from ingest.embedding import SPECIAL_TOKENS

router = APIRouter(tags=["embeddings"])


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, services: ServicesDep, _: ChatPrincipal) -> dict:
    embedder = services.embedder
    if body.model not in {services.embedding_model_name, embedder.model_id}:
        raise APIError(
            404,
            f"the model '{body.model}' does not exist; the embedding model here is "
            f"'{services.embedding_model_name}'",
            param="model",
            code="model_not_found",
        )
    if body.dimensions is not None and body.dimensions != embedder.dim:
        raise APIError(
            400,
            f"this model's embeddings have {embedder.dim} dimensions and cannot be shortened",
            param="dimensions",
            code="unsupported_value",
        )
    # The model would truncate a longer input without a word: refuse it instead.
    counts = [len(e.ids) for e in embedder.tokenizer.encode_batch(body.input, add_special_tokens=False)]
    for i, count in enumerate(counts):
        if count > embedder.max_chunk_tokens:
            raise APIError(
                400,
                f"input {i} has {count} tokens; this model embeds at most {embedder.max_chunk_tokens}",
                param="input",
                code="context_length_exceeded",
            )
    vectors = await run_in_threadpool(embedder.embed, body.input)
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": (
                base64.b64encode(vector.astype("<f4").tobytes()).decode()
                if body.encoding_format == "base64"
                else vector.tolist()
            ),
        }
        for i, vector in enumerate(vectors)
    ]
    tokens = sum(counts) + SPECIAL_TOKENS * len(counts)
    return {
        "object": "list",
        "data": data,
        "model": services.embedding_model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
