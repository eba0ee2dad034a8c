"""AstrAI playground, a Hugging Face Space: `python app.py` (host and port from GRADIO_SERVER_NAME/PORT)."""

from astrai.playground import create_app

demo = create_app()

if __name__ == "__main__":
    demo.launch()
