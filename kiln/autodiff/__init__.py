"""Reverse-mode autodiff: forward graph -> forward graph + backward graph (issue 4).

Input: a verified Graph whose inputs may require grad. Output: the VJP of every node comes from
its registry row (``OpDef.vjp``, written in prims so backward graphs fuse like forward ones);
``rules.vjp_of`` applies one row's rule to one node.
"""
