"""The worker side: the store and load jobs' steps (`steps`) and the threads that run them (`side`)."""
