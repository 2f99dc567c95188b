// One edge (source -> target, per weight-pair type) at every step of a sweep, in step order: its PK, PK rank,
// calibrated q and local causal effect with its interval. A step where the edge was not selected has one row
// with `selected` false and no values (the store holds the selected edges only; analyse with a --top-k that keeps
// every pair for a complete history). A rising PK says the two subspaces align more, not that the model uses
// the edge; the effect says that, on the inputs it was measured on.
// param sweep: string -- sweep id (default: the latest sweep; `headgraph sweep` prints it)
// param source: head -- source head, e.g. L0H2
// param target: head -- target head, e.g. L1H0
// param types: types = [] -- weight-pair types, e.g. OK (empty: all)
MATCH (run:Run) WHERE run.sweep = $sweep AND run.status = 'complete' AND run.step IS NOT NULL
OPTIONAL MATCH (a:Head)-[r]->(b:Head)
WHERE a.run_id = run.id AND a.name = $source AND b.name = $target AND (size($types) = 0 OR r.kind IN $types)
RETURN run.step AS step, r.kind AS kind, r IS NOT NULL AS selected, r.pk AS pk, r.rank AS pk_rank,
       r.q_model AS q_model, r.effect AS effect, r.effect_lo AS effect_lo, r.effect_hi AS effect_hi,
       r.effect_loss AS effect_loss, run.model AS model, run.id AS run
ORDER BY step, kind
