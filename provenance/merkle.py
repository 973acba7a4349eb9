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


def fold(subtree_hashes: list[bytes]) -> bytes:
    """MTH of a range from the roots of its complete subtrees, largest (leftmost) first.

    RFC 6962 splits a tree at the largest power of two below its size, so its left part is
    complete and its right part splits again: the root is the right fold of the subtrees.
    """
    result = subtree_hashes[-1]
    for left in reversed(subtree_hashes[:-1]):
        result = node_hash(left, result)
    return result


def extend(
    frontier: list[bytes], size: int, leaves: list[bytes]
) -> tuple[list[bytes], list[tuple[int, int, bytes]]]:
    """Append leaf hashes to a tree of ``size`` leaves given by its ``frontier`` (the roots of the
    complete subtrees covering it, largest first: one per set bit of the size).

    Returns the new frontier and every subtree ``(level, index, hash)``, level >= 1, that the new
    leaves complete: a leaf completes one per trailing one bit of its index, so the frontier works
    like a binary counter.
    """
    stack = list(frontier)
    completed: list[tuple[int, int, bytes]] = []
    for count, leaf in enumerate(leaves, start=size + 1):
        stack.append(leaf)
        level = 0
        while count & 1 == 0:  # the subtree at level + 1 that ends at this leaf is complete
            count, level = count >> 1, level + 1
            right = stack.pop()
            stack.append(node_hash(stack.pop(), right))
            completed.append((level, count - 1, stack[-1]))
    return stack, completed


def node_number(level: int, index: int) -> int:
    """Subtree (level, index)'s position in an in-order walk of the infinite perfect tree: leaves
    at even numbers, a subtree at 2^level - 1 past a multiple of 2^(level + 1). One integer per
    subtree, so a set of subtrees is looked up with one IN list on one indexed column."""
    return (index << (level + 1)) | ((1 << level) - 1)


def node_position(number: int) -> tuple[int, int]:
    """(level, index) of ``node_number``: the level is the count of trailing one bits."""
    level = ((number + 1) & -(number + 1)).bit_length() - 1
    return level, number >> (level + 1)


def subtrees(start: int, end: int) -> list[tuple[int, int]]:
    """The complete subtrees ``(level, index)`` covering leaves [start, end), leftmost first.

    Subtree (level, index) holds leaves [index * 2^level, (index + 1) * 2^level). Every range
    that RFC 6962's recursion asks the hash of starts at a multiple of a power of two at least
    as large as the range, so its binary decomposition lands on aligned subtrees.
    """
    found, size = [], end - start
    for level in reversed(range(size.bit_length())):
        if size >> level & 1:
            found.append((level, start >> level))
            start += 1 << level
    return found


def inclusion_ranges(index: int, size: int) -> list[tuple[int, int]]:
    """Leaf ranges whose MTHs make PATH(index, D[size]), in the proof's order (RFC 6962 2.1.1)."""
    if not 0 <= index < size:
        raise IndexError(f"leaf {index} is outside a tree of size {size}")
    ranges, start, end = [], 0, size
    while end - start > 1:
        k = _split(end - start)
        if index < start + k:
            ranges.append((start + k, end))
            end = start + k
        else:
            ranges.append((start, start + k))
            start += k
    return ranges[::-1]  # the recursion lists the sibling nearest the leaf first


def consistency_ranges(old_size: int, new_size: int) -> list[tuple[int, int]]:
    """Leaf ranges whose MTHs make PROOF(old_size, D[new_size]), in order (RFC 6962 2.1.2)."""
    if not 0 < old_size <= new_size:
        raise ValueError(
            f"consistency needs 0 < old size <= new size, got {old_size} and {new_size}"
        )
    ranges, start, end, m, complete = [], 0, new_size, old_size, True
    while m != end - start:
        k = _split(end - start)
        if m <= k:
            ranges.append((start + k, end))
            end = start + k
        else:
            ranges.append((start, start + k))
            start, m, complete = start + k, m - k, False
    if not complete:  # SUBPROOF(m, D[m], false) is the old tree's last subtree itself
        ranges.append((start, end))
    return ranges[::-1]


def inclusion_proof(index: int, leaves: list[bytes]) -> list[bytes]:
    """Audit path for leaf ``index`` in the tree of ``leaves`` (RFC 6962 PATH(m, D[n]))."""
    return [root(leaves[a:b]) for a, b in inclusion_ranges(index, len(leaves))]


def consistency_proof(old_size: int, leaves: list[bytes]) -> list[bytes]:
    """Proof that the first ``old_size`` leaves are a prefix of ``leaves`` (RFC 6962 PROOF(m, D[n]))."""
    return [root(leaves[a:b]) for a, b in consistency_ranges(old_size, len(leaves))]


def _sibling_sides(fn: int, sn: int, count: int) -> list[bool] | None:
    """RFC 9162's walk up from node ``fn`` of a tree whose last node is ``sn``, shared by both
    verifiers: for each of ``count`` proof hashes in turn, whether it is the left sibling. None
    when the proof's length does not fit the tree: the walk must reach the root (``sn == 0``)
    with its last hash, not before."""
    sides = []
    for _ in range(count):
        if sn == 0:
            return None
        left = bool(fn & 1) or fn == sn
        if left and not fn & 1:
            while fn and not fn & 1:
                fn >>= 1
                sn >>= 1
        sides.append(left)
        fn >>= 1
        sn >>= 1
    return sides if sn == 0 else None


def verify_inclusion(
    index: int, size: int, leaf: bytes, proof: list[bytes], expected_root: bytes
) -> bool:
    if not 0 <= index < size:
        return False
    sides = _sibling_sides(index, size - 1, len(proof))
    if sides is None:
        return False
    r = leaf
    for p, left in zip(proof, sides, strict=True):
        r = node_hash(p, r) if left else node_hash(r, p)
    return r == expected_root


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
    sides = _sibling_sides(fn, sn, len(path) - 1)
    if sides is None:
        return False
    fr = sr = path[0]
    for c, left in zip(path[1:], sides, strict=True):
        if left:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
        else:
            sr = node_hash(sr, c)
    return fr == old_root and sr == new_root
