"""dynvm.cluster.serving: a model served on Ray Serve (imports every other floor).

`ServingConfig` and every serving default (serving_config), the replica's routes and
life (_replica), one inference's way for HTTP and gRPC alike (_infer_seam), execution
(_replica_exec), batching (_batcher), metrics (_metrics, _replica_stats), deployment
(_deployment; serve_app: the Serve config file's builders), the local stack
(_local_stack: `serve_local`), the process's signals, drain and orphan watch, and the
generator replica (_generate_*). Its public names are exported, lazily, by
`dynvm.cluster`.
"""
