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
        Self::from_line(serde_json::from_str(line).map_err(|e| e.to_string())?)
    }

    /// [`Conversation::parse_line`] for a record already parsed (a Parquet
    /// row as JSON).
    pub fn from_json(record: serde_json::Value) -> Result<Self, String> {
        Self::from_line(serde_json::from_value(record).map_err(|e| e.to_string())?)
    }

    fn from_line(parsed: Line) -> Result<Self, String> {
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

    /// Cuts the conversation after `budget` bytes of message text (the
    /// message that crosses it is cut at a character boundary, later ones
    /// dropped). True when something was cut. Chat templates that render
    /// conversations prefix by prefix (the only ones training accepts)
    /// render the kept part exactly as before.
    pub fn truncate_text(&mut self, budget: usize) -> bool {
        let mut left = budget;
        for (i, m) in self.messages.iter_mut().enumerate() {
            if m.content.len() <= left {
                left -= m.content.len();
                continue;
            }
            let mut cut = left;
            while !m.content.is_char_boundary(cut) {
                cut -= 1;
            }
            m.content.truncate(cut);
            self.messages.truncate(i + 1);
            return true;
        }
        false
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
    fn long_texts_are_cut_after_the_budget() {
        let mut c = Conversation {
            messages: vec![
                Message::new("user", "héllo"),
                Message::new("assistant", "wörld"),
                Message::new("user", "x"),
            ],
        };
        assert!(!c.clone().truncate_text(100));
        // 6 bytes of "héllo", then 3 of "wörld": "w" and the two bytes of "ö".
        assert!(c.truncate_text(9));
        assert_eq!(c.messages.len(), 2);
        assert_eq!(c.messages[1].content, "wö");
        let mut c = Conversation { messages: vec![Message::new("user", "héllo")] };
        assert!(c.truncate_text(2));
        assert_eq!(c.messages[0].content, "h", "never inside a character");
    }

    #[test]
    fn explains_what_is_wrong() {
        assert!(Conversation::parse_line("{").is_err());
        assert!(Conversation::parse_line(r#"{"text":"x"}"#).unwrap_err().contains("neither"));
        let e = Conversation::parse_line(r#"{"messages":[{"role":"robot","content":"x"}]}"#).unwrap_err();
        assert!(e.contains("robot"), "{e}");
    }
}
