"""The training layer: the train step (`trainer`), its losses (`loss`, `vocab_tiling`, `posttrain`),
after-update hooks (`qk_clip`), optimizers, data, the loop (`loop`, `mb.train`), and the one place that
picks a run's loss, trainer and hooks from its config (`recipe`).
"""
