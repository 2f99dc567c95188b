// When each edge emerged over a sweep: the first step from which it is selected with q_model <= max_q at every
// later step of the sweep (`emerged`), the first step at which it was so at all, and at how many of the sweep's
// steps. An edge not significant at the last step has not emerged and is not listed. Emergence is a statement
// about these checkpoints only: the change happened somewhere between `emerged` and the step before it.
// role-emergence does the same for roles.
// param sweep: string -- sweep id (default: the latest sweep; `headgraph sweep` prints it)
// param max_q: float = 0.05 -- an edge is significant when its calibrated q_model is at most this
// param types: types = [] -- weight-pair types, e.g. OK (empty: all)
MATCH (run:Run) WHERE run.sweep = $sweep AND run.status = 'complete' AND run.step IS NOT NULL
WITH collect(run.step) AS steps
MATCH (run:Run) WHERE run.sweep = $sweep AND run.status = 'complete' AND run.step IS NOT NULL
MATCH (a:Head)-[r]->(:Head)
WHERE a.run_id = run.id AND (size($types) = 0 OR r.kind IN $types) AND r.q_model <= $max_q
WITH steps, r.kind AS kind, r.source AS source, r.target AS target, collect(run.step) AS significant
UNWIND steps AS step
WITH kind, source, target, significant, min(CASE WHEN step IN significant THEN step END) AS first,
     max(CASE WHEN step IN significant THEN NULL ELSE step END) AS last_gap, count(step) AS n_steps
UNWIND significant AS step
WITH kind, source, target, significant, first, last_gap, n_steps, step WHERE last_gap IS NULL OR step > last_gap
RETURN kind, source, target, min(step) AS emerged, first AS first_significant,
       size(significant) AS significant_steps, n_steps AS steps
ORDER BY emerged, kind, source, target
