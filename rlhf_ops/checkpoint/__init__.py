"""Checkpoints of a training run: the manager that saves, resumes, syncs and prunes them (``manager``), the
offline reader of a role's DCP shards (``dcp_reader``) and the HF export (``export``).

Layout: ``<root>/<experiment>/<run>/global_step_<N>/`` with ``MANIFEST.json`` written last (no
manifest, no checkpoint) and ``<run>/latest`` holding ``global_step_<N>``, updated after the manifest.
The manifest, the ``latest`` pointer and retention are the storage layer's
(:mod:`rlhf_ops.storage.manifest`): the stores, the Airflow side and this package share them, and
``storage`` never imports ``checkpoint``.
"""
