// One role at every step of a sweep, per head in layer order: whether the role test found it significant for
// the head (`significant`, null where roles were not tested) and every role significant for the head then.
// Significance is the test's decision at its --correction and alpha; a head that loses it at one step may only
// have fallen just under the threshold.
// param sweep: string -- sweep id (default: the latest sweep; `headgraph sweep` prints it)
// param role: string -- the role, e.g. induction or previous_token (headgraph roles lists them)
// param heads: list = [] -- head names, e.g. L1H0,L1H1 (empty: all)
MATCH (run:Run) WHERE run.sweep = $sweep AND run.status = 'complete' AND run.step IS NOT NULL
MATCH (h:Head) WHERE h.run_id = run.id AND (size($heads) = 0 OR h.name IN $heads)
RETURN run.step AS step, h.name AS head, h.layer AS layer, $role IN h.roles AS significant, h.roles AS roles,
       run.model AS model, run.id AS run
ORDER BY step, layer, h.head
