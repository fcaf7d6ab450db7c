# Makes _core a package for cimport (shmeval._core.ring); nothing here.
