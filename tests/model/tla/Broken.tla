---- MODULE Broken ----
VARIABLE x
Init == x = 
====
