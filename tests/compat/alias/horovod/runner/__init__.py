"""The part of Horovod's runner that Horovod's test utilities (utils/common.py) import."""
