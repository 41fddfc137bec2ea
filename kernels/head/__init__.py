"""Row-wise softmax statistics of the log-prob head over one block of vocabulary logits:
``naive`` (torch ops, the reference) and ``softmax`` (Triton: one read of the block forward,
one in-place pass backward)."""
