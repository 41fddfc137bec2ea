"""Row movement between a layer's compact rows and the packed inputs of its sequence kernels:
``naive`` (index_select and cat under autograd) and ``packed`` (the same forward; a backward that
writes each compact row's gradient once instead of summing full-size zero-padded gradients)."""
