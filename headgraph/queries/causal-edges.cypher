// Selected edges by their local causal effect (direct-path patching: how far the source's output moves the
// target's attention or value output), with PK, its rank, CS and q beside, strongest effect first. Only
// OQ/OK/OV edges of runs analysed with causal effects have one. A large effect on these inputs is evidence
// the model uses the edge there, not proof of a circuit. Q/K effects (attention moved, total variation) and V
// effects (relative change of the output) are different units: filter by type to compare like with like.
// effect_attr is the attribution (first-order loss change, nats per predicted token) of every pair; run.json's
// causal.agreement says per type how far it agrees with the exact effect_loss of the edges patched exactly;
// attr_reliable is false on the types where that Spearman rho is below 0.8 (rank effect_attr with care there),
// true where it is at least 0.8, null where nothing was patched exactly (no loss effects, or an encoder).
// param run: string -- run id (default: the latest complete run)
// param limit: int = 20 -- number of edges
// param types: types = [] -- weight-pair types, e.g. OK,OV (empty: OQ, OK and OV)
MATCH (run:Run) WHERE run.id = $run AND run.status = 'complete'
MATCH (a:Head)-[r]->(b:Head)
WHERE a.run_id = run.id AND r.effect IS NOT NULL AND (size($types) = 0 OR r.kind IN $types)
RETURN r.kind AS kind, a.name AS source, b.name AS target, r.effect AS effect, r.effect_lo AS effect_lo,
       r.effect_hi AS effect_hi, r.effect_loss AS effect_loss, r.effect_loss_lo AS effect_loss_lo,
       r.effect_loss_hi AS effect_loss_hi, r.effect_attr AS effect_attr, r.effect_attr_lo AS effect_attr_lo,
       r.effect_attr_hi AS effect_attr_hi,
       CASE WHEN r.kind IN run.attr_unreliable THEN false WHEN r.kind IN run.attr_reliable THEN true END
         AS attr_reliable, r.pk AS pk, r.rank AS pk_rank, r.cs AS cs, r.q_model AS q_model
ORDER BY effect DESC, kind, source, target
LIMIT $limit
