"""Tests of dynvm.shape_cluster: signatures to code families and buckets."""
