"""dynvm.cluster.fleet: compiled kernels shared by a fleet of replicas (imports store/).

A replica's link to the compile service and the store (_link), the service's work
(_compiler) and its Ray actors (compile_service: `start_compile_service`), announcements
(_announce), the program index and stamps (_records), shards (_shards), GPU and Triton
records (_gpu, _triton), ahead-of-time compiles (precompile) and one process's kernels
kept across restarts (_kernel_keeper: Note [Kept kernels]).
"""
