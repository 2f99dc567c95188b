// Roles of several models side by side: for the latest complete run of each model, per role, how many of the
// model's heads the role test finds it significant for, which ones (in layer order) and in which layers; one
// row per (role, model), the models of a role next to each other. Only roles tested on a model appear for it
// (decoders and encoders are tested for different roles); a count is a test decision, not a strength.
// param models: list = [] -- model names, e.g. gpt2,induction-2l (empty: every model in the store)
// param roles: list = [] -- roles, e.g. induction,previous_token (empty: all)
MATCH (run:Run)-[:OF_MODEL]->(m:Model) WHERE run.status = 'complete' AND (size($models) = 0 OR m.name IN $models)
WITH m, max(run.created) AS created
MATCH (run:Run)-[:OF_MODEL]->(m) WHERE run.status = 'complete' AND run.created = created
WITH m, max(run.id) AS run
MATCH (h:Head) WHERE h.run_id = run
UNWIND h.roles AS role
WITH m, run, role, h WHERE size($roles) = 0 OR role IN $roles
WITH m, run, role, h ORDER BY h.layer, h.head SKIP 0
RETURN role, m.name AS model, count(h) AS heads, m.n_layers * m.n_heads AS model_heads, collect(h.name) AS names,
       min(h.layer) AS first_layer, max(h.layer) AS last_layer, run
ORDER BY role, model
