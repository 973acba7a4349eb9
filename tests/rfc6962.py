"""An independent reading of RFC 6962 section 2.1 (BLAKE3, 0x00 leaf and 0x01 node prefixes),
written from the recursive definitions (MTH, PATH, PROOF) rather than from the implementation
under test (provenance/merkle.py). The audit-log and API tests verify proofs with it."""

from blake3 import blake3


def h_leaf(d: bytes) -> bytes:
    return blake3(b"\x00" + d).digest()


def h_node(a: bytes, b: bytes) -> bytes:
    return blake3(b"\x01" + a + b).digest()


def k_of(n: int) -> int:
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def mth(leaves: list[bytes]) -> bytes:
    if len(leaves) == 0:
        return blake3(b"").digest()
    if len(leaves) == 1:
        return leaves[0]
    k = k_of(len(leaves))
    return h_node(mth(leaves[:k]), mth(leaves[k:]))


def root_from_path(index: int, leaf: bytes, path: list[bytes], n: int) -> bytes:
    """Rebuild MTH(D[n]) from a leaf and its PATH by walking the same recursive split."""
    if n == 1:
        assert not path
        return leaf
    k = k_of(n)
    *inner, sibling = path
    if index < k:
        return h_node(root_from_path(index, leaf, inner, k), sibling)
    return h_node(sibling, root_from_path(index - k, leaf, inner, n - k))


def roots_from_consistency(m: int, leaves_new: int, proof: list[bytes], old_root: bytes) -> tuple[bytes, bytes]:
    """Rebuild (MTH(D[0:m]), MTH(D[0:n])) from PROOF(m, D[n]) via SUBPROOF's recursion."""

    def sub(m: int, n: int, proof: list[bytes], complete: bool) -> tuple[bytes, bytes]:
        if m == n:
            if complete:
                assert not proof
                return old_root, old_root
            (node,) = proof
            return node, node
        k = k_of(n)
        *inner, sibling = proof
        if m <= k:
            old, new = sub(m, k, inner, complete)
            return old, h_node(new, sibling)
        old, new = sub(m - k, n - k, inner, False)
        return h_node(sibling, old), h_node(sibling, new)

    return sub(m, leaves_new, proof, True)


def path(m: int, leaves: list[bytes]) -> list[bytes]:
    """PATH(m, D[n]) of RFC 6962 section 2.1.1, word for word."""
    n = len(leaves)
    if n == 1:
        return []
    k = k_of(n)
    if m < k:
        return [*path(m, leaves[:k]), mth(leaves[k:])]
    return [*path(m - k, leaves[k:]), mth(leaves[:k])]


def proof(m: int, leaves: list[bytes]) -> list[bytes]:
    """PROOF(m, D[n]) of RFC 6962 section 2.1.2, word for word."""

    def subproof(m: int, leaves: list[bytes], b: bool) -> list[bytes]:
        n = len(leaves)
        if m == n:
            return [] if b else [mth(leaves)]
        k = k_of(n)
        if m <= k:
            return [*subproof(m, leaves[:k], b), mth(leaves[k:])]
        return [*subproof(m - k, leaves[k:], False), mth(leaves[:k])]

    return subproof(m, leaves, True)
