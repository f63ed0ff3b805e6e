"""The ring table's word format, shared by the host (``graphpool.staging``) and the kernels (``.stage``).

Every 8-byte word of a ring row is ``value | generation << TAG_SHIFT``: a 48-bit value (a batch size or a
source address; x86-64 and AArch64 user addresses fit) and the 16-bit generation of the host write that
produced it (1..32767, cyclic, so a tagged word stays a positive int64; 0 never tags a written row). A
slot's commit word says which step's row is final, and which write made it. Plain integers: importable
without Triton.
"""
TAG_SHIFT = 48
VALUE_MASK = (1 << TAG_SHIFT) - 1
TAG_MASK = 0xFFFF
MAX_GENERATION = 0x7FFF


def commit_word(step: int, generation: int) -> int:
    """The commit word of ring slot ``step % slots``: step ``step``'s row is final, written by ``generation``."""
    return ((step & TAG_MASK) << 16) | generation
