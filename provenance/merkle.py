"""RFC 6962 Merkle tree hashing with BLAKE3: leaves, roots, inclusion and consistency proofs.

Leaf hash ``H(0x00 || data)``, node hash ``H(0x01 || left || right)``, the tree over n leaves
splits at the largest power of two below n (RFC 6962 section 2.1). Proof verification follows
RFC 9162 section 2.1.3 and 2.1.4 so a client can check proofs without trusting this code.
"""

from blake3 import blake3


def leaf_hash(data: bytes) -> bytes:
    return blake3(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return blake3(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """Largest power of two strictly below n (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


def root(leaves: list[bytes]) -> bytes:
    """Merkle tree hash of leaf hashes; the empty tree hashes the empty string."""
    if not leaves:
        return blake3(b"").digest()
    level = list(leaves)
    # Bottom-up pairing gives the same tree as RFC 6962's recursive split: an odd node is
    # promoted unchanged to the next level.
    while len(level) > 1:
        paired = [node_hash(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            paired.append(level[-1])
        level = paired
    return level[0]


def inclusion_proof(index: int, leaves: list[bytes]) -> list[bytes]:
    """Audit path for leaf ``index`` in the tree of ``leaves`` (RFC 6962 PATH(m, D[n]))."""
    n = len(leaves)
    if not 0 <= index < n:
        raise IndexError(f"leaf {index} is outside a tree of size {n}")
    if n == 1:
        return []
    k = _split(n)
    if index < k:
        return [*inclusion_proof(index, leaves[:k]), root(leaves[k:])]
    return [*inclusion_proof(index - k, leaves[k:]), root(leaves[:k])]


def consistency_proof(old_size: int, leaves: list[bytes]) -> list[bytes]:
    """Proof that the first ``old_size`` leaves are a prefix of ``leaves`` (RFC 6962 PROOF(m, D[n]))."""
    n = len(leaves)
    if not 0 < old_size <= n:
        raise ValueError(f"consistency needs 0 < old size <= new size, got {old_size} and {n}")
    return _subproof(old_size, leaves, complete=True)


def _subproof(m: int, leaves: list[bytes], complete: bool) -> list[bytes]:
    n = len(leaves)
    if m == n:
        return [] if complete else [root(leaves)]
    k = _split(n)
    if m <= k:
        return [*_subproof(m, leaves[:k], complete), root(leaves[k:])]
    return [*_subproof(m - k, leaves[k:], False), root(leaves[:k])]


def verify_inclusion(
    index: int, size: int, leaf: bytes, proof: list[bytes], expected_root: bytes
) -> bool:
    if not 0 <= index < size:
        return False
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == expected_root


def verify_consistency(
    old_size: int, new_size: int, old_root: bytes, new_root: bytes, proof: list[bytes]
) -> bool:
    if old_size == new_size:
        return not proof and old_root == new_root
    if not 0 < old_size < new_size or not proof:
        return False
    path = list(proof)
    if old_size & (old_size - 1) == 0:  # a power of two: the old root is a node of the new tree
        path.insert(0, old_root)
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return sn == 0 and fr == old_root and sr == new_root
