"""`sdserve accept`: the proofs of the fast path on a GPU node, above the engine they boot."""
