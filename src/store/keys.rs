//! The key layout under `/baton/<cluster>/`. Every key Baton writes is built here.

/// Keys of one cluster.
#[derive(Clone, Debug)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    pub fn new(cluster: &str) -> Self {
        Self {
            prefix: format!("/baton/{cluster}/"),
        }
    }

    /// `/baton/<cluster>/`
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The election name; candidates' keys live under `<election>/<lease id in hex>`.
    pub fn election(&self) -> String {
        format!("{}election", self.prefix)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn layout() {
        let k = super::Keys::new("prod");
        assert_eq!(k.prefix(), "/baton/prod/");
        assert_eq!(k.election(), "/baton/prod/election");
    }
}
