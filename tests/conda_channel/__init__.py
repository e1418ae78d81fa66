"""A conda channel for the tests, built on this machine from its own packages (see README.md).

build.build(out) makes (or reuses, from the cache) the channel, its broken twin and the
stand-in installer; server.ChannelServer serves them over loopback HTTP. Test fixture only:
nothing here is part of the imagefactory package.
"""
