"""dynvm.cluster.store: the kernel store, the ground floor (imports no other
cluster floor).

The `KernelStore` interface and its errors (_base), Redis (_redis) and local-directory
(_local) stores, sealed entries (_signed: Note [Signed artifacts]), `StoreConfig`
(_store_config) and the private redis-server of `dynvm serve` (_local_redis). Its public
names are exported by `dynvm.cluster`; importing this package loads neither Ray nor torch.
"""
