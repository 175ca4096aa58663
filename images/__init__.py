"""The step images: one Dockerfile per image, content-hash tags, and the build script.

``images.tags.resolve_image`` gives the tag of an image for the current tree (and
checks that it is built); ``python images/build.py`` (``make images``) builds what is
missing. See docs/images.md.
"""
