"""The judge: a generative reward model as a role of its own, and the built-in judge model.

Above the engines and the trainer in the layers (it runs an engine, and the built-in judge is
trained by the trainer's supervised loop); the verdict logic it applies is `streamrl.reward`'s.
"""
