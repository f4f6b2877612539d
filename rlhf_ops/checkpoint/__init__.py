"""Checkpoints: the on-disk layout, the manifest that commits a checkpoint, the ``latest`` pointer,
retention (``manifest.py``), and the sharded save/load of model, optimizer and trainer state.

Layout: ``<root>/<experiment>/<run>/global_step_<N>/`` with ``MANIFEST.json`` written last (no
manifest, no checkpoint) and ``<run>/latest`` holding ``global_step_<N>``, updated after the manifest.
"""
