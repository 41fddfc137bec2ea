"""Packed softmax attention: ``naive`` reference, ``varlen`` FlashAttention-2, ``tree_mask`` FlexAttention."""
