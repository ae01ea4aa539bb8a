//! Chat conversations as they appear in JSONL datasets.

use serde::{Deserialize, Serialize};

/// One turn of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// "system", "user" or "assistant".
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }

    pub fn is_assistant(&self) -> bool {
        self.role == "assistant"
    }
}

/// A conversation: the unit of training data.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Conversation {
    pub messages: Vec<Message>,
}

#[derive(Deserialize)]
struct ShareGptTurn {
    from: String,
    value: String,
}

#[derive(Deserialize)]
struct Line {
    #[serde(default)]
    messages: Option<Vec<Message>>,
    #[serde(default)]
    conversations: Option<Vec<ShareGptTurn>>,
}

impl Conversation {
    /// Reads one JSONL line in OpenAI (`messages`: role/content) or ShareGPT
    /// (`conversations`: from/value) form. The error says what is wrong.
    pub fn parse_line(line: &str) -> Result<Self, String> {
        let parsed: Line = serde_json::from_str(line).map_err(|e| e.to_string())?;
        let messages = match (parsed.messages, parsed.conversations) {
            (Some(m), None) => m,
            (None, Some(turns)) => turns
                .into_iter()
                .map(|t| {
                    let role = match t.from.as_str() {
                        "human" | "user" => "user",
                        "gpt" | "assistant" | "chatgpt" | "bing" | "bard" => "assistant",
                        "system" => "system",
                        other => return Err(format!("unknown ShareGPT speaker \"{other}\"")),
                    };
                    Ok(Message::new(role, t.value))
                })
                .collect::<Result<_, _>>()?,
            (Some(_), Some(_)) => {
                return Err("has both \"messages\" and \"conversations\"".into());
            }
            (None, None) => {
                return Err("has neither \"messages\" (OpenAI) nor \"conversations\" (ShareGPT)".into());
            }
        };
        for m in &messages {
            if !matches!(m.role.as_str(), "system" | "user" | "assistant") {
                return Err(format!("unknown role \"{}\"", m.role));
            }
        }
        if messages.is_empty() {
            return Err("has no messages".into());
        }
        Ok(Self { messages })
    }

    /// The conversation up to (not including) the first assistant turn: the
    /// prompt a target answers during regeneration and evaluation.
    pub fn first_prompt(&self) -> Vec<Message> {
        self.messages.iter().take_while(|m| !m.is_assistant()).cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_openai_and_sharegpt_forms() {
        let a = Conversation::parse_line(
            r#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo"}]}"#,
        )
        .unwrap();
        let b = Conversation::parse_line(
            r#"{"conversations":[{"from":"human","value":"hi"},{"from":"gpt","value":"yo"}]}"#,
        )
        .unwrap();
        assert_eq!(a, b);
        assert_eq!(a.first_prompt(), vec![Message::new("user", "hi")]);
    }

    #[test]
    fn explains_what_is_wrong() {
        assert!(Conversation::parse_line("{").is_err());
        assert!(Conversation::parse_line(r#"{"text":"x"}"#).unwrap_err().contains("neither"));
        let e = Conversation::parse_line(r#"{"messages":[{"role":"robot","content":"x"}]}"#).unwrap_err();
        assert!(e.contains("robot"), "{e}");
    }
}
