"""Checks of sharded models (FSDP2's ``fully_shard``: parameters as ``DTensor`` shards over a 1-D device mesh).

Under sharding the function checked is the global loss, the mean of every rank's local loss, which the gradient FSDP
leaves on the shards differentiates. Each rank moves its own shard of every parameter (and its own inputs) along one
global direction, and every number a probe decides on is summed across the ranks before anyone decides, so that all
ranks run the same evaluations in the same order (:mod:`.collective`: the reductions, and the protocol that ends a check
on every rank together when one rank's evaluation raises or a reduction times out; :mod:`.parameters`: the sharded
parameters, their local shards, the global index of a coordinate and the rank that holds it). Outside a sharded check
every function here is the identity, so the rest of the engine calls them unconditionally.
"""

SHARDED_NOTE = "sharded check across"
"""How the note of every sharded check's report begins."""
