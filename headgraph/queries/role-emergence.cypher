// When each role emerged on each head over a sweep: the first step from which the role test finds it
// significant at every later step of the sweep (`emerged`), the first step at which it did at all, and at how
// many of the sweep's steps. A role not significant at the last step has not emerged and is not listed. As for
// emergence (edges): the change happened somewhere between `emerged` and the step before it.
// param sweep: string -- sweep id (default: the latest sweep; `headgraph sweep` prints it)
// param roles: list = [] -- roles, e.g. induction,previous_token (empty: all)
MATCH (run:Run) WHERE run.sweep = $sweep AND run.status = 'complete' AND run.step IS NOT NULL
WITH collect(run.step) AS steps
MATCH (run:Run) WHERE run.sweep = $sweep AND run.status = 'complete' AND run.step IS NOT NULL
MATCH (h:Head) WHERE h.run_id = run.id
UNWIND h.roles AS role
WITH steps, role, h.name AS head, h.layer AS layer, run.step AS step WHERE size($roles) = 0 OR role IN $roles
WITH steps, role, head, layer, collect(step) AS significant
UNWIND steps AS step
WITH role, head, layer, significant, min(CASE WHEN step IN significant THEN step END) AS first,
     max(CASE WHEN step IN significant THEN NULL ELSE step END) AS last_gap, count(step) AS n_steps
UNWIND significant AS step
WITH role, head, layer, significant, first, last_gap, n_steps, step WHERE last_gap IS NULL OR step > last_gap
RETURN role, head, layer, min(step) AS emerged, first AS first_significant,
       size(significant) AS significant_steps, n_steps AS steps
ORDER BY emerged, role, layer, head
