// Edges of run A (`run`) and run B (`other`) matched by (source, target, type): shared, only in A, only in B,
// with each run's PK and within-type rank.
// param run: string -- run A (default: the latest complete run)
// param other: string -- run B
MATCH (ra:Run) WHERE ra.id = $run AND ra.status = 'complete'
MATCH (rb:Run) WHERE rb.id = $other AND rb.status = 'complete'
MATCH (a:Head)-[r]->(:Head) WHERE a.run_id = ra.id OR a.run_id = rb.id
WITH r.kind AS kind, r.source AS source, r.target AS target,
     max(CASE WHEN r.run_id = $run THEN r.pk END) AS pk_a, max(CASE WHEN r.run_id = $other THEN r.pk END) AS pk_b,
     min(CASE WHEN r.run_id = $run THEN r.rank END) AS rank_a, min(CASE WHEN r.run_id = $other THEN r.rank END) AS rank_b
RETURN CASE WHEN pk_a IS NOT NULL AND pk_b IS NOT NULL THEN 'shared' WHEN pk_a IS NOT NULL THEN 'only_a' ELSE 'only_b' END AS status,
       kind, source, target, pk_a, pk_b, rank_a, rank_b
ORDER BY status, kind, coalesce(rank_a, rank_b), source, target
