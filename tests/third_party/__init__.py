"""Models in the styles of public Flax code (LMs, a ViT), written for these tests and knowing nothing of the launcher.

Each module is a model as its authors would publish it (its own config class,
its own axis names); `glue.py` is everything a user adds to train it through
`launch.py --config.model.name=tests.third_party.glue:<builder>`.
"""
