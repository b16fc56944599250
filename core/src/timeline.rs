//! TODO(skeleton): see the module contract in the workspace issue.
