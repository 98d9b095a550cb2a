"""What GDN and KDA share: argument checks, the torch references, the Triton chunk pipeline
(layout, cumulative decay, WY transform, state passing, output) and recurrent kernel, and the
op factories (`ops`). `kernels.gdn` and `kernels.kda` bring only their intra-chunk matrices."""
