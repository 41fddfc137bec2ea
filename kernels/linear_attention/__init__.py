"""Chunkwise gated delta rule (KDA, Gated DeltaNet): ``naive`` reference, ``chunk`` on fla, ``state`` kernels."""
